"""`quantcli push DST REPO` and `convert --push-to-hub`: upload a finished quantcli output to the
Hugging Face Hub with huggingface_hub, only once it is complete (a manifest, written last; no
staging folder) and passes verify's structural checks. Credentials and the network are checked
before anything is verified or uploaded, so that each way it can fail is one line up front."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from quantcli.atomic import write_atomic
from quantcli.checkpoint.hub import current, network_errors
from quantcli.checkpoint.manifest import MANIFEST_NAME, STAGING_SUFFIX, finish_hint, unfinished_conversion
from quantcli.checkpoint.source import REPO_ID, open_local
from quantcli.errors import QuantcliError
from quantcli.formats.detect import detect

# huggingface_hub, the model card (which imports it) and verify (0.4 s more) are imported inside
# the functions: `convert --push-to-hub` says a bad repo id, HF_HUB_OFFLINE or a missing token in
# one line before it loads them.

# Above this size the resumable multi-commit upload is used where huggingface_hub has it;
# below, one commit with a message (a rerun skips files already uploaded either way).
LARGE_FOLDER_BYTES = 5 * 10**9
HUB = "https://huggingface.co"
REPO_TYPES = ("model", "dataset")  # where a checkpoint can live (a Space runs an app)


@dataclass
class Pushed:
    """What was uploaded, and where (the `pushed` object of the --json documents)."""

    repo_id: str
    revision: str | None
    private: bool
    url: str
    commit: str | None
    files: int
    bytes: int
    method: str  # upload_large_folder | upload_folder


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id):
        raise QuantcliError(f"{repo_id!r}: not a Hub repo id; write OWNER/NAME (e.g. my-org/llama-nvfp4)")


def check_can_push(repo_id: str, repo_type: str = "model") -> object:
    """The HfApi to push with, once the repo id is well formed, the Hub is reachable and a
    token is set and accepted; else one line saying which and the fix. The token: --token
    (checkpoint/hub.py), else HF_TOKEN or `hf auth login`'s."""
    from huggingface_hub import HfApi, get_token

    check_repo_id(repo_id)
    if repo_type not in REPO_TYPES:
        raise QuantcliError(f"--repo-type {repo_type}: a quantized checkpoint goes to a {' or '.join(REPO_TYPES)} "
                            f"repo")
    token = current().token
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise QuantcliError(f"push to {repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it and "
                            f"rerun (`quantcli push DST {repo_id}` uploads a finished output later)")
    if token is None and get_token() is None:
        raise QuantcliError(f"push to {repo_id}: not logged in to the Hugging Face Hub; run `hf auth login`, set "
                            f"HF_TOKEN or pass --token, then rerun")
    api = HfApi(token=token)
    _hub_call(repo_id, api.whoami)  # the network and the token, before anything is verified or uploaded
    return api


def check_complete(folder: Path) -> None:
    """A finished quantcli output: a folder with the manifest (written last), no staging folder beside it."""
    unfinished = unfinished_conversion(folder)
    if unfinished is not None:
        raise QuantcliError(f"{unfinished}; only a finished output is pushed")
    if folder.name.endswith(STAGING_SUFFIX):
        dst = folder.with_name(folder.name[: -len(STAGING_SUFFIX)])
        raise QuantcliError(f"{folder}: a staging folder of an unfinished conversion; {finish_hint(dst)}, then "
                            f"push {dst}")
    if not folder.is_dir():
        raise QuantcliError(f"{folder}: not a folder; push a finished output")
    partial = folder.with_name(folder.name + STAGING_SUFFIX)
    if partial.exists():
        raise QuantcliError(f"{folder}: {partial.name} is beside it, so a conversion into it is running or was "
                            f"interrupted; {finish_hint(folder)} first")
    if not (folder / MANIFEST_NAME).is_file():
        raise QuantcliError(f"{folder}: no {MANIFEST_NAME} (quantcli writes it last), so this is not a finished "
                            f"quantcli output; convert into a new folder and push that")


def check_verified(folder: Path) -> None:
    """verify's structural checks (no reference); an output with no quantized modules has none."""
    from quantcli.verify import verify_checkpoint

    detected = detect(open_local(folder, str(folder)))
    if detected is None or not detected.modules:
        return
    report = verify_checkpoint(str(folder))
    if not report.passed:
        first = report.faults[0]
        raise QuantcliError(f"{folder}: verify found {len(report.faults)} fault(s) (first: {first.tensor}: "
                            f"{first.fault}); nothing pushed. Run `quantcli verify {folder}` for the list")


def push(folder: Path, repo_id: str, *, private: bool = False, revision: str | None = None, api=None,
         commit_message: str | None = None, create_pr: bool = False, repo_type: str = "model") -> Pushed:
    """Create the repo (and branch) and upload `folder`, after the checks above (`api`: one
    check_can_push returned already, as convert --push-to-hub does before converting). A commit
    message or a pull request asks for one commit, so they always take upload_folder."""
    check_complete(folder)
    api = api or check_can_push(repo_id, repo_type)
    check_verified(folder)
    files = [p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts]
    size = sum(p.stat().st_size for p in files)
    _hub_call(repo_id, api.create_repo, repo_id, private=private, exist_ok=True, repo_type=repo_type)
    if revision:
        _hub_call(repo_id, api.create_branch, repo_id, branch=revision, exist_ok=True, repo_type=repo_type)
    _name_the_repo_in_card(folder, repo_id)
    large = getattr(api, "upload_large_folder", None)
    url = f"{HUB}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}" + (f"/tree/{revision}" if revision else "")
    if large is not None and size > LARGE_FOLDER_BYTES and not (commit_message or create_pr):
        _hub_call(repo_id, large, repo_id=repo_id, folder_path=folder, repo_type=repo_type, revision=revision,
                  private=private)
        commit, method = None, "upload_large_folder"
    else:
        info = _hub_call(repo_id, api.upload_folder, repo_id=repo_id, folder_path=folder, repo_type=repo_type,
                         revision=revision, ignore_patterns=[".cache/**"], create_pr=create_pr,
                         commit_message=commit_message or f"quantcli: upload {folder.name}")
        commit, method = getattr(info, "oid", None), "upload_folder"
        if create_pr:
            url = getattr(info, "pr_url", None) or url
    return Pushed(repo_id, revision, private, url, commit, len(files), size, method)


def _name_the_repo_in_card(folder: Path, repo_id: str) -> None:
    """The card's serving commands name the repo (they say MODEL until now); written atomically."""
    from quantcli.convert.model_card import retarget_serving

    readme = folder / "README.md"
    if not readme.is_file():
        return
    text = readme.read_text(encoding="utf-8")
    new = retarget_serving(text, repo_id)
    if new != text:
        write_atomic(readme, new)


def _hub_call(target: str, call, *args, **kwargs):
    """`call` with the Hub's failures turned into one line each (naming `target`, the repo):
    offline, unreachable, refused."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    repo_id = target
    try:
        return call(*args, **kwargs)
    except OfflineModeIsEnabled:
        raise QuantcliError(f"push to {repo_id}: huggingface_hub is in offline mode (HF_HUB_OFFLINE); unset it and "
                            f"rerun") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        why = {401: "the token was refused (not logged in, or it expired); run `hf auth login`",
               403: "the token may not write there; use a token with write access or a repo you own"}.get(
                   status, " ".join(str(exc).split())[:200])
        raise QuantcliError(f"push to {repo_id}: the Hub said {status or 'no'}: {why}") from None
    except network_errors() as exc:
        raise QuantcliError(f"push to {repo_id}: cannot reach {HUB} ({type(exc).__name__}); check the network (or "
                            f"HF_ENDPOINT) and rerun `quantcli push`") from None


__all__ = ["Pushed", "check_can_push", "check_complete", "check_repo_id", "check_verified", "push"]
