"""A layer's GPTQ solves side by side on the CPU's threads, with the bytes of one after the other.

Each solve (factorization, column loop, output errors) runs on one intra-op thread whichever
thread runs it (shard.compute_threads sets torch's to 1), and its bits depend on the thread
count, not on which thread or when: so whole solves may overlap, never one solve's ops. The
modules that share one H (q/k/v, gate/up) form one task, solved one after the other on one
thread, which computes H's factorization once (GptqPass._factor keeps it per thread).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from quantcli.kernels.chunks import in_callers_mode

RESERVE = 2**30  # bytes of available memory a task started beside others must leave untouched


def available_memory() -> int | None:
    """The memory the system can give without swapping (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def solve_cost(shape: tuple[int, ...]) -> float:
    """A module's solve, roughly: its H's factorization (K^3) and its N K^2 products, per expert."""
    *experts, n, k = shape
    return float(math.prod(experts)) * (k ** 3 + n * k * k)


def solve_bytes(shape: tuple[int, ...]) -> int:
    """A module's solve at its peak, besides H: two and a half K x K FP64 matrices (J H J and L,
    then L, L^-1 and two quarters of products: rounding/gptq.py upper_inverse_factor,
    lower_inverse), two FP32 ones (the factor, the errors' H) and four FP32 copies of the weight."""
    n, k = shape[-2], shape[-1]
    return 8 * 5 * k * k // 2 + 4 * 2 * k * k + 4 * 4 * n * k


def side_by_side(solve: Callable, make: Callable[[int], object], keys: list[str], threads: int,
                 costs: list[float] | None = None, sizes: list[int] | None = None,
                 room: Callable[[], int | None] = available_memory) -> list:
    """solve(make(j)) for each j of `keys`, in order: the works of one key one after the other in
    one task, up to `threads` tasks side by side, the costliest first (`costs` per work: the last
    to start is then a short one), each as soon as any running one ends (not the oldest: a
    Llama layer's solves, down_proj's on one thread and gate/up's then q/k/v's on the other,
    took 11.5 s where they take 9.6 s). make() runs here, on the calling thread (the reader is not
    shared), as a task starts. Memory (`sizes` per work, bytes): a task starts beside running ones
    only while room() exceeds all of theirs and its own by RESERVE (else, or where room() is
    unknown, after them), so side by side never needs more memory than the system has to give."""
    tasks: dict[str, list[int]] = {}
    for j, key in enumerate(keys):
        tasks.setdefault(key, []).append(j)
    if threads <= 1 or len(tasks) <= 1:
        return [solve(make(j)) for j in range(len(keys))]
    order = sorted(tasks.values(), key=lambda task: -sum(costs[j] for j in task)) if costs else list(tasks.values())
    need = [max(sizes[j] for j in task) if sizes else 0 for task in order]
    results: list = [None] * len(keys)

    @in_callers_mode  # the solvers take the caller's inference mode
    def run(indices: list[int], works: list) -> None:
        for m, j in enumerate(indices):
            results[j] = solve(works[m])
            works[m] = None  # its weight and statistic go as soon as it is solved

    def fits(t: int) -> bool:
        free = room() if sizes else math.inf
        return free is not None and sum(b for _, b in running.values()) + need[t] + RESERVE <= free

    pool = ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="quantcli-solve")
    running: dict = {}  # future -> (task index, bytes)

    def wait_for_one() -> None:
        """Until a running task ends (whichever: a short one's thread takes the next task
        while a long one runs on); once a failure is seen here, every running task is let
        end, the first failure in task order among them is raised, and no task starts after."""
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        if any(f.exception() is not None for f in done):
            wait(running)
            failed = [(t, f) for f, (t, _) in running.items() if f.exception() is not None]
            min(failed, key=lambda e: e[0])[1].result()  # the first in task order
        for f in done:
            del running[f]

    try:
        for t, indices in enumerate(order):
            while running and (len(running) == threads or not fits(t)):
                wait_for_one()  # before this task's weights are read
            running[pool.submit(run, indices, [make(j) for j in indices])] = (t, need[t])
        while running:
            wait_for_one()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure: the running solves end, no new one starts
    return results
