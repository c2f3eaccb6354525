"""A weight pass on several ranks: per-layer statistics are summed over groups of rows in global
batch order whatever the number of ranks (1, 2 and 3 ranks in threads, on sums whose bits depend
on the order and the grouping), and on a spawned 2-rank gloo group the statistics the pass is handed, its output
and a --resume of a run killed in one process are the bytes of one process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from faults import fault_env, tree_state
from safetensors.torch import load_file

from quantcli.convert.passes.ordered_sum import OrderedSum
from quantcli.testing import make_llama

TESTS = Path(__file__).parent
KEYS = {"a": (3, torch.float64), "b": (2, torch.float32)}  # key: (K, dtype of its rows)


class ThreadWorld:
    """Rank `rank` of `size` threads meeting at a barrier: settle_all and all_gather as World."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier):
        self.rank, self.size, self.board, self.barrier = rank, size, board, barrier
        self.lead = rank == 0

    def _exchange(self, value):
        self.board[self.rank] = value
        self.barrier.wait()
        out = list(self.board)
        self.barrier.wait()
        return out

    def settle_all(self, work):
        return json.loads(json.dumps(self._exchange(work())))  # JSON, as through the store

    def all_gather(self, x):
        return [t.clone() for t in self._exchange(x)]


def _statistic(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x.T @ x


def _batches(batches: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Per batch, the rows the modules record: magnitudes 1e-8..1e8 of both signs (so the bits of
    a sum depend on its order and grouping), "b" absent from some batches, "a" recorded twice in
    others, 1-3 rows each time."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(batches):
        adds = []
        for key, (k, dtype) in KEYS.items():
            for _ in range(2 if key == "a" and b % 3 == 1 else 0 if key == "b" and b % 4 == 2 else 1):
                shape = (int(torch.randint(1, 4, (1,), generator=g)), k)
                mag = 10.0 ** (torch.rand(shape, generator=g, dtype=torch.float64) * 16 - 8)
                sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
                adds.append((key, (mag * sign).to(dtype)))
        out.append(adds)
    return out


def _ranks_sum(batches, size: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    board, barrier, result = [None] * size, threading.Barrier(size), ({}, {})

    def rank(r: int) -> None:
        sums = OrderedSum(ThreadWorld(r, size, board, barrier), len(batches), keep=r == 0, statistic=_statistic)
        for adds in batches[r::size]:  # the walk's split: batches r, r + n, ...
            for key, rows in adds:
                sums.add(key, rows)
            sums.end_batch()
        found = sums.finish()
        if r == 0:
            result[0].update(found[0])
            result[1].update(found[1])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return result


def test_statistics_are_summed_in_batch_order_on_any_number_of_ranks(monkeypatch):
    import quantcli.convert.passes.ordered_sum as ordered_sum

    monkeypatch.setattr(ordered_sum, "GROUP_ROWS", 4)  # groups of >= 4 rows: they span batches and ranks
    batches = _batches(7)  # 7 batches: the last round leaves ranks out on 2 and 3 ranks
    expected: dict[str, torch.Tensor] = {}
    for key in KEYS:  # one process, by hand: each batch's rows appended in batch order, a group closed
        group: list[torch.Tensor] = []  # once it holds >= 4 rows (a batch's rows never split), the rest last
        batch_rows = [torch.cat(rows) for adds in batches if (rows := [r for k, r in adds if k == key])]
        for i, rows in enumerate(batch_rows):
            group.append(rows)
            if sum(x.shape[0] for x in group) >= 4 or i == len(batch_rows) - 1:
                part = _statistic(torch.cat(group))
                expected[key] = part if key not in expected else expected[key] + part
                group = []
    for size in (1, 2, 3):
        got, counts = _ranks_sum(batches, size)
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert got[key].dtype == torch.float64 and torch.equal(got[key], expected[key]), (size, key)
            assert counts[key] == sum(r.shape[0] for adds in batches for k, r in adds if k == key)
    per_rank = [sum((_statistic(r) for adds in batches[i::2] for k, r in adds if k == "a"),
                    torch.zeros(3, 3, dtype=torch.float64)) for i in range(2)]
    assert not torch.equal(per_rank[0] + per_rank[1], expected["a"])  # the order matters for this data


def _rank_worker(rank: int, size: int, port: int, jobs: list[dict], log: str) -> None:
    """One rank: run every job's command line, with the nearest pass installed unless the job says
    `"nearest": false` (then the registered passes, GPTQ), and log its exit code."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QUANTCLI_RANK_TIMEOUT": "20"})
    import datetime

    import torch.distributed as dist
    from nearest_pass import install

    import quantcli.convert.passes as passes
    from quantcli.cli.app import _run

    registered = passes.WEIGHT_PASSES
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    for job in jobs:
        if job.get("nearest", True):
            install()
        else:
            passes.WEIGHT_PASSES = registered
        os.environ.update(job.get("env", {}).get(str(rank), {}))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = _run(job["argv"])
        with open(f"{log}.{rank}", "a") as f:
            f.write(json.dumps({"name": job["name"], "code": code, "err": err.getvalue()}) + "\n")
    os._exit(0)


def _two_ranks(jobs: list[dict], log: Path) -> dict[str, dict[int, dict]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [mp.get_context("spawn").Process(target=_rank_worker, args=(r, 2, port, jobs, str(log))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert not p.is_alive(), "a rank hung"
    out: dict[str, dict[int, dict]] = {}
    for r in range(2):
        for line in Path(f"{log}.{r}").read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["name"], {})[r] = rec
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("ranks")
    src = make_llama(tmp / "llama", hidden=64, layers=2, shards=2)
    data = tmp / "ids.jsonl"  # 5 batches: rank 0 runs 3, rank 1 runs 2
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + 13 * j) % 512 for j in range(8 + 4 * (i % 3))]})
                            + "\n" for i in range(5)))
    argv = ["convert", str(src), "DST", "--recipe", "nvfp4", "--activations", "static", "--kv-cache", "fp8",
            "--calibration", str(data), "--calibration-samples", "5", "--device", "cpu", "--quiet"]
    at = {name: [str(tmp / name) if a == "DST" else a for a in argv] for name in ("plain", "one", "two", "killed")}
    from nearest_pass import STATISTICS_ENV

    env = {**os.environ, STATISTICS_ENV: str(tmp / "stats-one")}
    (tmp / "stats-one").mkdir()
    (tmp / "stats-two").mkdir()
    with contextlib.redirect_stdout(io.StringIO()):
        from quantcli.cli.app import _run

        assert _run(at["plain"]) == 0
    for name, extra in (("one", {}), ("killed", fault_env(kill_after_layers=1))):
        proc = subprocess.run([sys.executable, str(TESTS / "nearest_pass.py"), *at[name]],
                              env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == (-9 if extra else 0), proc.stderr
    logs = _two_ranks([{"name": "two", "argv": at["two"], "env": {"0": {STATISTICS_ENV: str(tmp / "stats-two")}}},
                       {"name": "resumed", "argv": [*at["killed"], "--resume"]}], tmp / "log")
    return {"tmp": tmp, "logs": logs}


@pytest.mark.slow
def test_two_ranks_hand_the_pass_one_process_s_statistics_and_write_its_bytes(runs):
    tmp = runs["tmp"]
    assert all(rec["code"] == 0 and rec["err"] == "" for rec in runs["logs"]["two"].values()), runs["logs"]
    one, two = sorted((tmp / "stats-one").iterdir()), sorted((tmp / "stats-two").iterdir())
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 14
    for a, b in zip(one, two):
        x, y = load_file(a), load_file(b)
        assert x["statistic"].dtype == y["statistic"].dtype == torch.float64
        assert torch.equal(x["statistic"], y["statistic"]) and int(x["tokens"]) == int(y["tokens"]) == 56, a.name
    assert tree_state(tmp / "two") == tree_state(tmp / "one") == tree_state(tmp / "plain")


@pytest.mark.slow
def test_two_ranks_resume_a_run_killed_in_one_process(runs):
    tmp = runs["tmp"]
    assert all(rec["code"] == 0 for rec in runs["logs"]["resumed"].values()), runs["logs"]
    assert tree_state(tmp / "killed") == tree_state(tmp / "plain")
