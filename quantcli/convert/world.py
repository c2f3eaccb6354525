"""The ranks of a conversion on torch.distributed: who this process is, the work split, and the
few points where the ranks meet.

A rank is what torchrun starts (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
environment), or what `quantcli convert --workers N` starts on one machine (this process is rank
0 and spawns ranks 1..N-1 running the same command line). Without them the world is one process
and every operation here is the identity, so the single-process path is unchanged.

Long phases (reading fused groups, converting shards) end in `settle`: each rank posts its
outcome in the job's key-value store and waits for the others while checking their heartbeats,
so a rank that dies or hangs stops the rest after QUANTCLI_RANK_TIMEOUT seconds (default 60)
with one line, however long the phase itself takes. Small results travel with the meeting as
JSON (`settle_all`); tensors move in short collectives (all_reduce MAX; all_gather, for sums
taken in a fixed order) under the process group's own timeout. torch's object collectives are
not used: they unpickle what peers send.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist

from quantcli.convert.destination import FilesystemError
from quantcli.errors import QuantcliError

T = TypeVar("T")
BEAT_S = 0.5  # heartbeat period
# A collective runs only once every rank has posted to the meeting before it, so it is short;
# but a rank that dies right after posting leaves the others blocked inside gloo/NCCL (where
# Ctrl-C does not reach) until this timeout: keep it close to the rank timeout.
COLLECTIVE_MARGIN_S = 30


class PeerRefused(QuantcliError):
    """Another rank refused the input (its own line says why): a fresh run leaves nothing."""


class PeerStopped(FilesystemError):
    """Another rank died, hung or hit a filesystem fault: the staging folder is kept for --resume."""


def rank_timeout() -> float:
    return float(os.environ.get("QUANTCLI_RANK_TIMEOUT", "60"))


K = TypeVar("K")  # a shard name or a batch index: sortable


def assign_largest_first(sizes: Mapping[K, int], ranks: int) -> dict[K, int]:
    """Longest processing time first: the largest item (a shard's bytes, an eval batch's tokens)
    goes to the least loaded rank (ties: the lower rank, then the smaller key), so every rank
    computes the same split from the same sizes."""
    loads = [(0, r) for r in range(ranks)]
    out: dict[K, int] = {}
    for item in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, r = heapq.heappop(loads)
        out[item] = r
        heapq.heappush(loads, (load + sizes[item], r))
    return out


@dataclass
class World:
    """This process's place among the ranks. The default is one process (rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    store: Any = None  # the process group's key-value store (None for one process)
    comm_device: torch.device = torch.device("cpu")
    resume_hint: str = "rerun with --resume"
    on_wait: Callable[[], None] = lambda: None  # called while waiting (rank 0's progress bar)
    _seq: int = 0
    _prefix: str = "quantcli/0"
    _beats: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def rank_device(self, device: str) -> str:
        """--device cuda (or auto with CUDA) on one of several ranks means its own GPU."""
        return f"cuda:{self.local_rank}" if self.comm_device.type == "cuda" else device

    def mine(self, sizes: Mapping[str, int]) -> set[str]:
        """The shards this rank works on, out of `sizes` (shard -> bytes)."""
        return {s for s, r in assign_largest_first(sizes, self.size).items() if r == self.rank}

    # --- meeting points

    def settle(self, work: Callable[[], T]) -> T:
        """Run `work` here; return once every rank has finished its own, raising this rank's
        error or, if another rank failed, PeerRefused / PeerStopped naming it."""
        if self.size == 1:
            return work()
        return self._settle(work, share=False)[0]

    def settle_all(self, work: Callable[[], T]) -> list[T]:
        """settle, then every rank's result (rank order). The results travel as JSON through
        the store, so they must be JSON values; nothing a rank sends is ever unpickled."""
        if self.size == 1:
            return [work()]
        return self._settle(work, share=True)[1]

    def lead_alone(self, work: Callable[[], T]) -> T | None:
        """settle `work` run on rank 0 alone (the others wait for it): its result there, None elsewhere."""
        return self.settle(lambda: work() if self.lead else None)

    def from_lead(self, work: Callable[[], T]) -> T:
        """settle `work` run on rank 0 alone; every rank gets rank 0's result (a JSON value)."""
        return self.settle_all(lambda: work() if self.lead else None)[0]

    def merged(self, part: Mapping[str, T]) -> dict[str, T]:
        """Every rank's `part` (JSON values) in one dict, rank order: one rank's keys of its own work."""
        out: dict[str, T] = {}
        for each in self.settle_all(lambda: dict(part)):
            out.update(each)
        return out

    def _settle(self, work: Callable[[], T], share: bool) -> tuple[T, list]:
        try:
            out = work()
        except BaseException as exc:
            keep = isinstance(exc, FilesystemError) or not isinstance(exc, QuantcliError)
            message = str(exc) if isinstance(exc, QuantcliError) else f"{type(exc).__name__} {exc}".strip()
            # Posted, not waited for: the others see it at this meeting (or find the store gone).
            with contextlib.suppress(RuntimeError, OSError):
                self.store.set(f"{self._prefix}/meet/{self._seq + 1}/{self.rank}",
                               json.dumps({"error": message, "keep": keep}))
            raise
        outcomes = self._meet({"error": None, **({"value": out} if share else {})})
        failed = [(r, o) for r, o in enumerate(outcomes) if o["error"]]
        if failed:
            self._all_read(sum(not o["error"] for o in outcomes))
            r, o = failed[0]
            cls = PeerStopped if any(x["keep"] for _, x in failed) else PeerRefused
            raise cls(f"rank {r}: {o['error']}" if self.lead else f"rank {self.rank} stopped: rank {r} failed: "
                      f"{o['error']}")
        return out, [o.get("value") for o in outcomes]

    def _meet(self, outcome: dict) -> list[dict]:
        """Post `outcome`, wait for every rank's (watching their heartbeats), return them all."""
        self._seq += 1
        key = f"{self._prefix}/meet/{self._seq}"
        try:
            self.store.set(f"{key}/{self.rank}", json.dumps(outcome))
            waiting = set(range(self.size))
            while waiting:
                waiting = {r for r in waiting if not self.store.check([f"{key}/{r}"])}
                if waiting:
                    self._check_alive(waiting)
                    self.on_wait()
                    time.sleep(0.05)
            return [json.loads(self.store.get(f"{key}/{r}")) for r in range(self.size)]
        except (RuntimeError, OSError) as exc:  # the store is gone: rank 0 (which serves it) died
            raise PeerStopped(f"rank {self.rank} stopped: rank 0 is gone (it failed or died; its own line says "
                              f"why; {type(exc).__name__}); {self.resume_hint}") from None

    def _all_read(self, readers: int) -> None:
        """Before a failed job ends: rank 0 (whose process may serve the store) waits until every
        rank still there has read the meeting's outcomes, so each says why in its own words."""
        key = f"{self._prefix}/meet/{self._seq}/read"
        with contextlib.suppress(RuntimeError, OSError):
            self.store.add(key, 1)
            deadline = time.monotonic() + rank_timeout()
            while self.lead and self.store.add(key, 0) < readers and time.monotonic() < deadline:
                time.sleep(0.02)

    def _check_alive(self, waiting: set[int]) -> None:
        now = time.monotonic()
        for r in sorted(waiting):
            beat = self.store.add(f"{self._prefix}/beat/{r}", 0)
            seen, since = self._beats.get(r, (-1, now))
            if beat != seen:
                self._beats[r] = (beat, now)
            elif now - since > rank_timeout():
                raise PeerStopped(f"rank {r} stopped responding for {rank_timeout():.0f} s (it died or hung); "
                                  f"{self.resume_hint}")

    def leave(self) -> None:
        """After a job that ended well: rank 0 (whose process may serve the store) waits until
        every rank has read the last meeting's outcomes before it may exit."""
        key = f"{self._prefix}/left"
        with contextlib.suppress(RuntimeError, OSError):
            self.store.add(key, 1)
            deadline = time.monotonic() + rank_timeout()
            while self.lead and self.store.add(key, 0) < self.size and time.monotonic() < deadline:
                time.sleep(0.02)

    # --- collectives (every rank has arrived: they are short)

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `x` over the ranks (a tensor collective: nothing pickled)."""
        if self.size == 1:
            return x
        y = x.to(self.comm_device).clone()
        self._collective(lambda: torch.distributed.all_reduce(y, op=torch.distributed.ReduceOp.MAX))
        return y.cpu()

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape and dtype on every rank), in rank order: the exact bits
        each sent, so that a sum over them can be taken in an order every rank agrees on."""
        if self.size == 1:
            return [x]
        y = x.to(self.comm_device).contiguous()
        out = [torch.empty_like(y) for _ in range(self.size)]
        self._collective(lambda: torch.distributed.all_gather(out, y))
        return [o.cpu() for o in out]

    def _collective(self, op: Callable[[], object]) -> None:
        try:
            op()
        except RuntimeError as exc:  # a peer died between the meeting and the collective
            raise PeerStopped(f"rank {self.rank} stopped: a collective failed ({str(exc).splitlines()[0]}); "
                              f"{self.resume_hint}") from None

    # --- progress: bytes done by every rank, counted in the store

    def progress(self, local: Callable[[int, str], None] | None) -> Callable[[int, str], None]:
        """The per-tensor callback for this rank: counts bytes in the store; rank 0 passes the job's
        total on to `local` (its bar), also while it waits for the others."""
        if self.size == 1:
            return local or (lambda n, s: None)
        key, seen = f"{self._prefix}/bytes", [0]

        def report(total: int, shard: str) -> None:
            if local is not None and total > seen[0]:
                local(total - seen[0], shard)
                seen[0] = total

        if self.lead and local is not None:
            self.on_wait = lambda: report(self.store.add(key, 0), "")
        return lambda n, shard: report(self.store.add(key, n), shard)


# --- opening the world


_opened = [0]  # conversions this process has run in a group: each gets its own store keys


@contextlib.contextmanager
def open_world(device: str, store: Any = None, env: Mapping[str, str] | None = None) -> Iterator[World]:
    """The world this process belongs to (from torchrun's environment, or `store` and `env` from
    `spawn_ranks`); a group this function creates is destroyed on leaving. One process: World()."""
    env = os.environ if env is None else env
    size = int(env.get("WORLD_SIZE", "1"))
    if size <= 1:
        yield World()
        return
    rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    created = not dist.is_initialized()
    if cuda:
        torch.cuda.set_device(local)
    if created:
        timeout = timedelta(seconds=rank_timeout() + COLLECTIVE_MARGIN_S)
        backend = "nccl" if cuda else "gloo"
        if store is not None:
            # The prefix env:// adds on the other ranks, so that their keys meet ours.
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                    world_size=size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
    _opened[0] += 1
    # A store spawn_ranks serves is fresh, and the ranks it started are new processes whose first
    # world this is: every rank numbers it 1 (a second --workers job in this process would
    # otherwise look for keys its ranks never write).
    number = 1 if store is not None else _opened[0]
    world = World(rank, size, local, dist.distributed_c10d._get_default_store(),
                  torch.device("cuda", local) if cuda else torch.device("cpu"), _prefix=f"quantcli/{number}")
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(world, stop), daemon=True)
    beat.start()
    threads = torch.get_num_threads()
    if not cuda:  # the ranks on one machine share its cores instead of each taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(env.get("LOCAL_WORLD_SIZE", size))))
    try:
        yield world
        world.leave()
    finally:
        torch.set_num_threads(threads)
        stop.set()
        beat.join()
        if created:
            dist.destroy_process_group()


def _heartbeat(world: World, stop: threading.Event) -> None:
    key = f"{world._prefix}/beat/{world.rank}"
    while not stop.is_set():
        try:
            world.store.add(key, 1)
        except (RuntimeError, OSError):  # the store is gone; the next meeting says so
            return
        stop.wait(BEAT_S)
