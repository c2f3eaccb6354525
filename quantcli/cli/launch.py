"""`quantcli convert --workers N` on one machine: this process becomes rank 0 and spawns ranks
1..N-1 (torch.multiprocessing, start method spawn) that run the same command line with the
environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
so they take exactly the path of a torchrun rank; the job's store is served from here."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

from quantcli.cli.exits import SPAWNED_RANK
from quantcli.convert.world import World, open_world, rank_timeout

ADDR = "127.0.0.1"


def launched() -> bool:
    """This process is a rank of a torchrun (or --workers) job already."""
    return "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def rank_world(device: str, workers: int = 1, argv: list[str] | None = None,
               entry: Callable[[list[str]], Any] | None = None) -> Iterator[World]:
    """The ranks this conversion runs on: torchrun's (when it started this process), N spawned
    here for --workers N (each calls `entry(argv)`: the command line's main, handed down by the
    command so that nothing here imports it), or this process alone."""
    if workers > 1 and not launched():
        assert entry is not None, "--workers needs the entry point the ranks run"
        with spawn_ranks(entry, list(argv or []), workers) as (store, env), open_world(device, store, env) as world:
            yield world
    else:
        with open_world(device) as world:
            yield world


@contextlib.contextmanager
def spawn_ranks(entry: Callable[[list[str]], Any], argv: list[str],
                workers: int) -> Iterator[tuple[Any, dict[str, str]]]:
    """Serve the store, start ranks 1..workers-1, yield (store, rank 0's environment); on leaving,
    wait for them (a rank still running after the others' timeout is terminated)."""
    store = dist.TCPStore(ADDR, 0, workers, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=rank_timeout() + 60))
    common = {"WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": ADDR,
              "MASTER_PORT": str(store.port)}
    procs = _start_ranks(entry, argv, common, workers)
    grace = 3.0  # after a failure here the ranks learn it at their next meeting, a shard away at most
    try:
        yield store, {**common, "RANK": "0", "LOCAL_RANK": "0"}
        grace = rank_timeout() + 10
    except KeyboardInterrupt:
        grace = 0.0  # Ctrl-C or SIGTERM: stop them now (they keep DST.partial for --resume)
        raise
    finally:
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.terminate()
                p.join()


def _start_ranks(entry: Callable[[list[str]], Any], argv: list[str], common: dict[str, str], workers: int) -> list:
    """Ranks 1..workers-1, started with SIGINT ignored (inherited through exec, and Python keeps
    an ignored SIGINT ignored): the terminal sends Ctrl-C to the whole process group, and a rank
    interrupted while it imports torch would print a traceback; rank 0 stops them instead."""
    ctx = mp.get_context("spawn")
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (an embedding caller): signals are not ours to set
        previous = None
    try:
        procs = []
        for r in range(1, workers):
            env = {**common, "RANK": str(r), "LOCAL_RANK": str(r), SPAWNED_RANK: "1"}
            procs.append(ctx.Process(target=_rank_main, args=(entry, argv, env), daemon=True))
            procs[-1].start()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return procs


def _rank_main(entry: Callable[[list[str]], Any], argv: list[str], env: dict[str, str]) -> None:
    """A spawned rank: the command line's entry point (pickled by name, so the child imports it
    itself), which exits with the rank's code."""
    _die_with_parent()
    os.environ.update(env)
    entry(argv)


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank when rank 0's process dies (even by SIGKILL), so no rank outlives
    the job as an orphan; it then exits as on any SIGTERM, keeping DST.partial for --resume."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call: do not start at all
        raise SystemExit(143)
