"""passes/side_by_side.py: the layer's GPTQ solves run as whole tasks (one per H) on several
threads, their results in order, the works made on the caller's thread, at most `threads` tasks'
works alive, the first failure raised and no task started after it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from quantcli.convert.passes.side_by_side import side_by_side


def test_one_task_per_key_in_order_on_its_own_thread_and_the_tasks_side_by_side():
    barrier = threading.Barrier(2, timeout=10)  # passes only if two tasks run at once
    ran: dict[str, list[tuple[int, str]]] = {}
    made_on = set()

    def make(j):
        made_on.add(threading.current_thread().name)
        return j

    def solve(j):
        if j in (0, 3):  # the first work of each of the first two tasks
            barrier.wait()
        ran.setdefault(keys[j], []).append((j, threading.current_thread().name))
        return j * 10

    keys = ["qkv", "qkv", "qkv", "o", "mlp", "mlp"]
    assert side_by_side(solve, make, keys, threads=2) == [0, 10, 20, 30, 40, 50]
    assert made_on == {threading.current_thread().name}  # the reader is used on one thread only
    for key, runs in ran.items():
        assert [j for j, _ in runs] == [j for j, k in enumerate(keys) if k == key]  # in order
        assert len({name for _, name in runs}) == 1  # one H's modules on one thread (its Factor)
        assert runs[0][1].startswith("quantcli-solve")


class Peak:
    """How many of something are alive at once, and the most there were (thread-safe)."""

    def __init__(self):
        self.alive = self.most = 0
        self._lock = threading.Lock()

    def up(self) -> None:
        with self._lock:
            self.alive += 1
            self.most = max(self.most, self.alive)

    def down(self) -> None:
        with self._lock:
            self.alive -= 1


def test_at_most_threads_tasks_are_made_before_the_oldest_ends():
    works = Peak()

    def make(j):
        works.up()
        return j

    def solve(j):
        works.down()
        return j

    assert side_by_side(solve, make, [str(j) for j in range(8)], threads=2) == list(range(8))
    assert works.most <= 3  # two running, a third made once the oldest has ended


def test_a_task_starts_when_any_running_one_ends_not_only_the_oldest():
    c_ran = threading.Event()

    def solve(j):
        if j == 0:  # the long task: still running when the short one ends and the third has run
            assert c_ran.wait(timeout=10), "the third task waited for the oldest"
        if j == 2:
            c_ran.set()
        return j

    assert side_by_side(solve, lambda j: j, ["long", "short", "third"], threads=2) == [0, 1, 2]


def test_failures_are_raised_in_task_order_after_every_running_task_ends():
    ended = []

    def solve(j):
        if j == 1:
            raise ValueError("module 1 failed first")
        time.sleep(0.2)
        ended.append(j)
        raise ValueError("module 0 failed later")

    with pytest.raises(ValueError, match="module 0"):  # task 0's, though task 1's failure came first
        side_by_side(solve, lambda j: j, ["a", "b", "c"], threads=2)
    assert ended == [0]  # task 0 ran to its end; task 2 never started


def test_the_first_failure_is_raised_and_no_task_starts_after_it():
    made = []

    def solve(j):
        if j == 0:
            raise ValueError("H of module 0 is not finite")
        time.sleep(0.2)  # task 1 ends after task 0's failure
        return j

    with pytest.raises(ValueError, match="module 0"):
        side_by_side(solve, lambda j: made.append(j) or j, [str(j) for j in range(6)], threads=2)
    assert made == [0, 1]  # the third task's weights were never read


def test_one_thread_or_one_task_runs_on_the_callers_thread_in_its_inference_mode():
    names, modes = set(), set()

    def solve(j):
        names.add(threading.current_thread().name)
        modes.add(torch.is_inference_mode_enabled())
        return j

    assert side_by_side(solve, lambda j: j, ["a", "b", "c"], threads=1) == [0, 1, 2]
    assert side_by_side(solve, lambda j: j, ["a", "a"], threads=4) == [0, 1]
    assert names == {threading.current_thread().name}
    with torch.inference_mode():
        side_by_side(solve, lambda j: j, ["a", "b"], threads=2)
    assert modes == {False, True}


def test_the_costliest_task_starts_first():
    started = []

    def make(j):
        started.append(j)
        return j

    keys = ["qkv", "qkv", "o", "down"]
    assert side_by_side(lambda j: j, make, keys, threads=2, costs=[2.0, 2.0, 1.0, 9.0]) == [0, 1, 2, 3]
    assert started == [3, 0, 1, 2]  # down (9), then q/k/v (4), then o (1)


def test_a_task_starts_beside_others_only_where_the_memory_is_there():
    def at_once(room) -> int:
        solves = Peak()

        def solve(j):
            solves.up()
            time.sleep(0.05)  # long enough for a second task to start if it may
            solves.down()
            return j

        assert side_by_side(solve, lambda j: j, ["a", "b", "c"], threads=2, sizes=[3 * 2**30] * 3,
                            room=room) == [0, 1, 2]
        return solves.most

    assert at_once(lambda: 64 * 2**30) == 2
    assert at_once(lambda: 5 * 2**30) == 1  # two need 6 GiB + the 1 GiB reserve: one at a time
    assert at_once(lambda: None) == 1  # unknown: one at a time
