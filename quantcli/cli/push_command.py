"""`quantcli push DST REPO`: the command's options and output (app.py registers it). Its own
module so the command line's table of options stays one screen; the work is in push.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

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
    revision: Annotated[Optional[str], typer.Option(metavar="BRANCH", help="Upload to BRANCH (created if missing).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON document.")] = False,
) -> None:
    """Verify and upload a finished output to the Hugging Face Hub.

    The structural checks of `quantcli verify` run first; nothing is uploaded if they fail."""
    from quantcli.cli.push import push
    from quantcli.cli.render import console, emit_json
    from quantcli.reports import envelope

    pushed = push(folder, repo, private=private, revision=revision)  # huggingface_hub shows its progress
    if json_out:  # quantcli/schemas/push.json
        emit_json(envelope("push", {"pushed": pushed}, source=folder, destination=repo))
    else:
        console().print(pushed.url)
    raise typer.Exit(0)
