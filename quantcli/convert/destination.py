"""The destination: every problem with DST refused before any work, the staging folder
`DST.partial` it is written in, filesystem faults named in one line, and the final swap that
puts the staging folder in place without ever deleting the old DST first."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

from quantcli.checkpoint.manifest import MANIFEST_NAME, is_staging
from quantcli.convert.lock import LOCK_NAME, StagingLock
from quantcli.convert.progress import PROGRESS_NAME, load_progress
from quantcli.convert.records import RunOptions
from quantcli.errors import CheckpointError

ASIDE_SUFFIX = ".quantcli-replaced"  # the old DST, renamed aside by --overwrite until the new one is in


class FilesystemError(CheckpointError):
    """Disk full, file-size limit, permission: the staging folder is kept for --resume."""


# errno -> (what happened, what to do)
FS_FAULTS = {
    errno.ENOSPC: ("disk full (no space left on device)", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EFBIG: ("file size limit reached (EFBIG)", "raise the limit (ulimit -f) or use a filesystem that "
                                                      "takes larger files"),
    errno.EACCES: ("permission denied", "make the folder writable"),
    errno.EPERM: ("permission denied", "make the folder writable"),
    errno.EROFS: ("read-only file system", "write to a writable filesystem"),
}


def staging_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


def aside_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ASIDE_SUFFIX)


def check_destination(src: Path | None, dst: Path, run: RunOptions) -> None:
    """Every destination problem, refused before the source is read or anything is written."""
    _check_named(dst)
    stage = staging_dir(dst)
    # DST is replaced by renaming a finished folder onto it: a link would be replaced, not its
    # target written, so a link is refused whatever it points at (the user names the real folder).
    if dst.is_symlink():
        raise CheckpointError(f"{dst}: is a symbolic link (to {os.readlink(dst)}); quantcli replaces DST by "
                              f"renaming a finished folder onto it, so pass the real folder {dst.resolve()} instead")
    _check_parent(dst)
    if src is not None:
        _check_apart_from_source(src, dst)
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder; choose another destination")
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        raise CheckpointError(f"{stage}: exists and is not a folder, so it cannot be the staging folder of "
                              f"{dst.name}; remove it or choose another destination")
    holder = StagingLock(stage).live_holder()
    if holder is not None:
        raise CheckpointError(holder.busy_message(dst))
    _check_aside(dst, run)
    _check_ours(stage, is_staging(stage), "staging folder")
    dst_full = dst.exists() and any(dst.iterdir())
    if dst_full and run.overwrite:
        _check_ours(dst, (dst / MANIFEST_NAME).is_file(), "output")
    if dst_full and not run.overwrite:
        _check_resume_into_full(dst, run)
    if stage.exists() and not run.resume and not run.overwrite:
        raise CheckpointError(f"{stage}: an interrupted run left this; rerun with --resume to continue "
                              f"it or --overwrite to start over")
    if run.resume and (stage / PROGRESS_NAME).exists():
        load_progress(stage / PROGRESS_NAME)  # a corrupt one is refused now, touching nothing


def _check_named(dst: Path) -> None:
    """'', '.', '..' or '/': the staging folder needs a name beside DST."""
    if dst.name in ("", ".", ".."):
        named = Path(os.path.abspath(dst))
        if not named.name:
            raise CheckpointError(f"{dst}: the file-system root cannot be a destination; name a new folder")
        raise CheckpointError(f"{dst or '.'}: is the folder {named}, not a new one; name the output folder, "
                              f"e.g. {named / 'quantized'}")


def _check_apart_from_source(src: Path, dst: Path) -> None:
    """DST must not hold the source (a rename or --overwrite would move or delete it), nor, for a
    source folder, lie inside it (its files are copied from the whole tree). A single file's
    folder may hold DST: only that file and the companion files beside it are read."""
    dst_r, src_r = dst.resolve(), src.resolve()
    if dst_r == src_r:
        raise CheckpointError(f"{dst}: is the source itself; name a new folder for the output")
    if src_r.is_dir() and src_r in dst_r.parents:
        raise CheckpointError(f"{dst}: is inside the source folder, whose files are all read; choose a destination "
                              f"outside {src_r}")
    if dst_r in src_r.parents:
        raise CheckpointError(f"{dst}: contains the source {src}; choose a destination that does not hold it"
                              + (f", such as a new folder {src_r.parent / 'quantized'}" if src_r.is_file() else ""))


def _check_parent(dst: Path) -> None:
    """The nearest existing ancestor must be a writable folder (missing parents are created)."""
    parent = dst.absolute().parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"{dst}: its parent {parent} is not a folder; choose another destination")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{dst}: cannot write in {parent} (permission denied or read-only); "
                              f"choose a writable destination")


def _check_aside(dst: Path, run: RunOptions) -> None:
    """DST.quantcli-replaced exists only after a crash inside the final swap of --overwrite."""
    aside, stage = aside_dir(dst), staging_dir(dst)
    if not (aside.exists() or aside.is_symlink()):
        return
    if dst.exists():
        raise CheckpointError(f"{aside}: the previous {dst.name}, set aside by an interrupted --overwrite; the new "
                              f"{dst} is complete: delete {aside} once you have checked it, then rerun")
    if not (run.resume and stage.is_dir()):
        raise CheckpointError(f"{aside}: the previous {dst.name}, set aside by an interrupted --overwrite; rerun "
                              f"with --resume to put the new output from {stage} in place, or move {aside} back "
                              f"to {dst}")


def _check_ours(folder: Path, ours: bool, what: str) -> None:
    """--overwrite (and a new run's staging folder) replace only what quantcli wrote: a quantcli
    output (its manifest) or staging folder (its .quantcli-* files), or an empty folder."""
    if ours or not folder.is_dir():
        return
    theirs = sorted(p.name for p in folder.iterdir())
    if theirs:
        raise CheckpointError(f"{folder}: holds files quantcli did not write (not a quantcli {what}: e.g. "
                              f"{theirs[0]}{f' and {len(theirs) - 1} more' if len(theirs) > 1 else ''}); quantcli "
                              f"replaces only its own {what} or an empty folder: delete it yourself or choose "
                              f"another destination")


def _check_resume_into_full(dst: Path, run: RunOptions) -> None:
    """A non-empty DST without --overwrite: only --resume of a run that may replace it goes on."""
    stage = staging_dir(dst)
    finished = (dst / MANIFEST_NAME).is_file()
    if not run.resume and finished and not stage.exists():
        raise CheckpointError(f"{dst}: holds a finished quantcli output (complete: nothing to resume); pass "
                              f"--overwrite to convert into it again, or choose another destination")
    if not run.resume and stage.exists():
        raise CheckpointError(f"{dst}: exists, and {stage.name} beside it is an interrupted run; rerun with --resume "
                              f"to continue it, or --overwrite to start over")
    if not run.resume:
        _check_ours(dst, False, "output")
    if stage.is_dir():
        state = load_progress(stage / PROGRESS_NAME) if (stage / PROGRESS_NAME).exists() else {}
        if not state.get("replace_dst"):
            _check_ours(dst, finished, "output")
            raise CheckpointError(f"{dst}: exists and is not empty, and the interrupted run in {stage} was not "
                                  f"started with --overwrite; pass --overwrite with --resume to replace {dst}")
        return
    if not finished:  # a finished quantcli output is compared after the plan
        raise CheckpointError(f"{dst}: exists and is not empty, and there is no interrupted run ({stage}) to "
                              f"resume; quantcli never replaces a folder it did not write: delete it yourself or "
                              f"choose another destination")


# --- filesystem faults


def filesystem_error(exc: OSError, path: Path, dst: Path) -> FilesystemError:
    """One line naming the file and saying which fault (disk full, size limit, permission)."""
    file = Path(exc.filename2 or exc.filename or path)  # filename2: the destination of a copy
    stage = staging_dir(dst)
    writing = stage in file.parents or file in (stage, dst) or file.parent == dst.absolute().parent \
        or file.parent == dst.parent
    what, fix = FS_FAULTS.get(exc.errno, (exc.strerror or type(exc).__name__, "fix that"))
    if not writing and exc.errno in (errno.EACCES, errno.EPERM):
        fix = "make it readable"
    kept = f" ({stage} is kept)" if stage.exists() else ""
    return FilesystemError(f"{file}: {what} while {'writing' if writing else 'reading'}; {fix}, then rerun "
                           f"with --resume to continue{kept}")


@contextlib.contextmanager
def writing(path: Path, dst: Path):
    """An OSError raised inside becomes a FilesystemError naming `path` (or the file it names)."""
    try:
        yield
    except BrokenPipeError:  # stdout or stderr closed (-v piped into head): an interruption, not the disk
        raise
    except OSError as exc:
        raise filesystem_error(exc, path, dst) from None


# --- the staging folder and the final swap

# Every DST this process put in place: an interrupt that lands after the swap (while rank 0 waits
# for the other ranks, or prints the summary) finds its output complete, and the CLI says so.
INSTALLED: set[Path] = set()


def install(stage: Path, dst: Path) -> list[str]:
    """Put the staging folder in place of DST without ever deleting DST first: the old one is
    renamed aside, the new one renamed in, and only then the old one deleted. A crash in
    between leaves both (check_destination explains what to do). Returns warnings."""
    aside = aside_dir(dst)
    with writing(dst, dst):
        if dst.exists():
            os.rename(dst, aside)
        os.rename(stage, dst)
    warnings = []
    if aside.exists():
        try:
            shutil.rmtree(aside)
        except OSError as exc:
            warnings.append(f"{aside}: the replaced destination could not be deleted ({exc.strerror}); "
                            f"delete it yourself")
    INSTALLED.add(dst.absolute())  # after the old copy is gone: an interrupt before then leaves it
    return warnings


def manifest_doc(folder: Path) -> dict:
    """The manifest of a finished output as a dict ({} when absent or unreadable)."""
    try:
        doc = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def leftovers(stage: Path) -> list[Path]:
    """What a staging folder holds besides the lock and a progress file's temporary."""
    ours = {LOCK_NAME, PROGRESS_NAME + ".tmp"}
    return [p for p in stage.iterdir() if p.name not in ours and not p.name.startswith(LOCK_NAME + ".stale-")]


def empty_staging(stage: Path, dst: Path) -> None:
    """--overwrite: start over inside the staging folder this run now holds."""
    with writing(stage, dst):
        for p in leftovers(stage):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, nearest first."""
    out = []
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        out.append(parent)
        parent = parent.parent
    return out


def discard(stage: Path, created: list[Path]) -> None:
    """Remove what a refused fresh run made: its staging folder and the parents it created."""
    shutil.rmtree(stage, ignore_errors=True)
    for parent in created:
        with contextlib.suppress(OSError):
            parent.rmdir()
