"""`quantcli push DST REPO`: the command's options and output (app.py registers it). Its own
module so the command line's table of options stays one screen; the work is in push.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.checkpoint.hub import hub_access
from quantcli.cli.options import Token
from quantcli.reports import envelope

# push, render and source (torch) are imported inside the functions: app.py imports this module
# for `quantcli --help`.

# convert's --push-to-hub options (declared here, with the push command, to keep app.py short)
PushToHub = Annotated[Optional[str], typer.Option(
    metavar="REPO", help="Then verify and upload DST to the Hub repo REPO (created if missing), as `quantcli push`.")]
Private = Annotated[bool, typer.Option("--private", help="--push-to-hub: create the repo private.")]
PushRevision = Annotated[Optional[str], typer.Option(
    metavar="BRANCH", help="--push-to-hub: upload to BRANCH (created if missing).")]


def push_command(
    folder: Annotated[Path, typer.Argument(metavar="DST", help="A finished quantcli output folder.")],
    repo: Annotated[str, typer.Argument(metavar="REPO", help="Hub repo id OWNER/NAME (created if missing).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    revision: Annotated[Optional[str], typer.Option(
        metavar="BRANCH", help="Upload to BRANCH (created if missing).")] = None,
    commit_message: Annotated[Optional[str], typer.Option(
        metavar="TEXT", help="The commit's message.  [default: quantcli: upload DST]")] = None,
    create_pr: Annotated[bool, typer.Option(
        "--create-pr", help="Open a pull request with the upload instead of committing to the branch.")] = False,
    repo_type: Annotated[str, typer.Option(metavar="TYPE", help="model or dataset.")] = "model",
    token: Token = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON document.")] = False,
) -> None:
    """Verify and upload a finished output to the Hugging Face Hub.

    The structural checks of `quantcli verify` run first; nothing is uploaded if they fail."""
    from quantcli.cli.push import push
    from quantcli.cli.render import console, emit_json

    folder, repo = _in_push_order(folder, repo)
    with hub_access(token):  # huggingface_hub shows its progress
        pushed = push(folder, repo, private=private, revision=revision, commit_message=commit_message,
                      create_pr=create_pr, repo_type=repo_type.lower())
    if json_out:  # quantcli/schemas/push.json
        emit_json(envelope("push", {"pushed": pushed}, source=folder, destination=repo))
    else:
        console().print(pushed.url)
    raise typer.Exit(0)


def _in_push_order(folder: Path, repo: str) -> tuple[Path, str]:
    """(DST, REPO); `push REPO DST` (hf upload's order) when REPO is an existing folder and DST a
    repo id that names no local path: read the other way round, with a warning."""
    from quantcli.checkpoint.source import REPO_ID
    from quantcli.cli.render import console

    if not folder.exists() and Path(repo).is_dir() and REPO_ID.match(str(folder)):
        console(stderr=True).print(f"warning: push takes DST first: reading this as `quantcli push {repo} {folder}` "
                                   f"(hf upload takes REPO first, quantcli push DST REPO)")
        return Path(repo), str(folder)
    return folder, repo
