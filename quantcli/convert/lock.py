"""One run at a time per staging folder: `STAGE/.quantcli-lock`, created with O_EXCL; a lock whose
process is gone is stale and taken over atomically."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from quantcli.errors import CheckpointError

LOCK_NAME = ".quantcli-lock"


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    path: Path
    raw: str
    being_written: bool = False

    @property
    def alive(self) -> bool:
        if self.pid == 0:
            return self.being_written
        if self.host != socket.gethostname():
            return True  # another machine's process cannot be checked: assume it runs
        return _pid_alive(self.pid)

    def busy_message(self, dst: Path) -> str:
        where = "" if self.host == socket.gethostname() else f" on {self.host}"
        who = f"pid {self.pid}{where}" if self.pid else "its lock is being written"
        return (f"{dst}: another quantcli convert ({who}) is writing it (lock {self.path}); wait for it to "
                f"finish, or stop it and rerun with --resume" + (f"; if that run is gone, delete {self.path}"
                                                                   if where else ""))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class StagingLock:
    """`STAGE/.quantcli-lock` holding {"pid", "host", "token"}: created with O_CREAT|O_EXCL, so one run
    holds a staging folder at a time. A lock whose pid is gone (on this host) is stale and taken
    over: renamed away atomically (only one run can move a given file), checked to be the stale
    one, then created anew with O_EXCL."""

    def __init__(self, stage: Path):
        self.path = stage / LOCK_NAME
        self.content = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex})
        self.held = False

    def holder(self) -> LockHolder | None:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(raw)
            return LockHolder(int(obj["pid"]), str(obj["host"]), self.path, raw)
        except (ValueError, KeyError, TypeError):
            pass
        # Unreadable: a run between creating and writing it (a young file), or one that died there.
        try:
            young = time.time() - self.path.stat().st_mtime < 10
        except FileNotFoundError:
            return None
        return LockHolder(0, socket.gethostname(), self.path, raw, being_written=young)

    def live_holder(self) -> LockHolder | None:
        holder = self.holder()
        return holder if holder is not None and holder.alive else None

    def acquire(self, dst: Path) -> None:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is not None and holder.alive:
                    raise CheckpointError(holder.busy_message(dst)) from None
                if holder is not None:
                    self._remove_stale(holder)
                continue
            try:
                os.write(fd, self.content.encode())
            finally:
                os.close(fd)
            self.held = True
            return
        raise CheckpointError(f"{dst}: could not take the lock {self.path} (other runs keep taking it); "
                              f"make sure no other quantcli convert writes {dst}, then rerun")

    def _remove_stale(self, stale: LockHolder) -> None:
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return  # another run moved it first
        if moved.read_text() != stale.raw:
            # Another run replaced the stale lock between our read and the rename: put its live
            # lock back (link fails if yet another lock appeared, and then that one stands).
            with contextlib.suppress(FileExistsError):
                os.link(moved, self.path)
        moved.unlink()

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                if self.path.read_text() == self.content:
                    self.path.unlink()
            self.held = False
