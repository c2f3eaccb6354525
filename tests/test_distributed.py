"""Conversion on several torch.distributed ranks (gloo, CPU): byte-identical to one process.

Two spawned groups are shared by every case (a torch import per rank is the cost): a 2-rank
group runs half the recipes, a re-layout of a quantized source, two calibrated jobs (the ranks
split the batches; with an activation-weighted search rank 0 calibrates alone) and finally a job
whose rank 1 is killed mid-run; a 3-rank group runs the other recipes, a fused group split over
ranks, a calibrated MoE and the --resume of the killed job. Each output is compared file by file with one process's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from faults import HOOKS, assert_nothing_left, fault_env, tree_state
from safetensors.torch import load_file, save_file

from quantcli.convert.world import assign_largest_first
from quantcli.testing import make_llama, make_moe

CALIBRATE = importlib.util.find_spec("transformers") is not None
GROUP_A = [("nvfp4", "llama"), ("fp8-block", "llama"), ("mxfp4", "moe"), ("int8-channel", "llama")]
GROUP_B = [("fp8", "llama"), ("fp8-channel", "moe"), ("mxfp8", "llama"), ("nvfp4", "moe"), ("int4", "llama128")]


def _rank_worker(rank: int, size: int, port: int, jobs: list[dict], log: str) -> None:
    """One rank: join the group once, run every job's command line, log (exit code, stderr)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QUANTCLI_RANK_TIMEOUT": "6"})
    import datetime

    import torch.distributed as dist

    from quantcli.cli.app import _run

    sys.path.insert(0, str(HOOKS))
    import fault_hooks

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    for job in jobs:
        env = job.get("env", {}).get(str(rank), {})
        undo = fault_hooks.install(env)  # this process is running: its sitecustomize has run
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = _run(job["argv"])
        undo()
        with open(f"{log}.{rank}", "a") as f:
            f.write(json.dumps({"name": job["name"], "code": code, "err": err.getvalue()}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no teardown handshake with a rank that may be dead


def _run_group(size: int, jobs: list[dict], log: Path) -> dict[str, dict[int, dict]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_worker, args=(r, size, port, jobs, str(log))) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
        assert not p.is_alive(), "a rank hung"
    out: dict[str, dict[int, dict]] = {}
    for r in range(size):
        path = Path(f"{log}.{r}")
        for line in path.read_text().splitlines() if path.exists() else []:
            rec = json.loads(line)
            out.setdefault(rec["name"], {})[r] = rec
    return out


def _reshard(src: Path, out: Path, shards: int) -> Path:
    """Tensors dealt round-robin by name over `shards` files: q/k/v of a layer land in different
    shards (and so on different ranks)."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out.mkdir(parents=True)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in sorted(tensors)[i::shards]}
        save_file(part, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _one_process(argv: list[str]) -> int:
    from quantcli.cli.app import _run

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return _run(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Sources, the one-process references, and both spawned groups' outputs and logs."""
    tmp = tmp_path_factory.mktemp("dist")
    # Two layers: layer 0's inputs are embeddings, so only a second layer's calibrated input scales
    # pass through matmuls whose last bits follow the thread count (model/threads.py).
    src = {"moe": make_moe(tmp / "moe", hidden=64, layers=2, shards=3),
           "llama": _reshard(make_llama(tmp / "llama1", hidden=64, layers=2, shards=1), tmp / "llama", 4),
           # int4 takes K % 128 == 0 only
           "llama128": _reshard(make_llama(tmp / "llama128-1", hidden=128, layers=1, shards=1), tmp / "llama128", 3)}
    ref, a, b = tmp / "ref", tmp / "a", tmp / "b"

    def cases(out: Path, table) -> list[dict]:
        return [{"name": f"{r}-{s}", "argv": ["convert", str(src[s]), str(out / f"{r}-{s}"), "--recipe", r,
                                              "--device", "cpu", "--quiet"]} for r, s in table]

    quantized = ref / "nvfp4-llama"
    extra = {"relayout": ["--recipe", "nvfp4", "--layout", "compressed-tensors"], "dequantize": ["--recipe", "bf16"]}
    jobs_a = cases(a, GROUP_A) + [{"name": "relayout", "argv": ["convert", str(quantized), str(a / "relayout"),
                                                                *extra["relayout"], "--quiet"]}]
    if CALIBRATE:  # ranks split the batches (maxima) or rank 0 calibrates alone (a weighted search)
        ids = tmp / "ids.jsonl"
        ids.write_text("".join(json.dumps({"input_ids": [(7 * i + 13 * j) % 512 for j in range(8 + 4 * (i % 3))]})
                               + "\n" for i in range(12)))
        static = ["--activations", "static", "--kv-cache", "fp8", "--calibration", str(ids),
                  "--calibration-samples", "12", "--device", "cpu", "--quiet"]
        jobs_a += [{"name": "calibrated-llama", "argv": ["convert", str(src["llama"]), str(a / "calibrated-llama"),
                                                         "--recipe", "nvfp4", *static]},
                   {"name": "calibrated-search", "argv": ["convert", str(src["llama"]), str(a / "calibrated-search"),
                                                          "--recipe", "nvfp4", "--scale-search", "mse", *static]}]
    jobs_a.append({"name": "killed", "argv": ["convert", str(src["llama"]), str(tmp / "killed"), "--recipe", "nvfp4",
                                              "--quiet"], "env": {"1": fault_env(kill_after_shards=1)}})
    jobs_b = cases(b, GROUP_B) + [
        {"name": "dequantize", "argv": ["convert", str(quantized), str(b / "dequantize"), *extra["dequantize"],
                                        "--quiet"]}]
    if CALIBRATE:  # three ranks over the MoE's batches: an expert may be reached on one rank only
        jobs_b.append({"name": "calibrated-moe", "argv": ["convert", str(src["moe"]), str(b / "calibrated-moe"),
                                                          "--recipe", "nvfp4", *static]})
    for job in [*jobs_a[:-1], *jobs_b]:  # the same command lines in one process (nvfp4-llama first)
        argv = list(job["argv"])
        argv[2] = str(ref / job["name"])
        assert _one_process(argv) == 0, argv
    logs = _run_group(2, jobs_a, tmp / "log-a")
    killed_state = tree_state(tmp / "killed.partial")
    jobs_b.append({"name": "resumed", "argv": ["convert", str(src["llama"]), str(tmp / "killed"), "--recipe",
                                               "nvfp4", "--quiet", "--resume"]})
    nan = _reshard(src["llama"], tmp / "nan", 4)  # a NaN in a tensor that is no fused group's
    bad = next(f for f in nan.glob("*.safetensors") if "model.layers.1.self_attn.o_proj.weight" in load_file(f))
    tensors = load_file(bad)
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad, metadata={"format": "pt"})
    jobs_b.append({"name": "refused", "argv": ["convert", str(nan), str(tmp / "refused"), "--recipe", "nvfp4",
                                               "--quiet"]})
    logs.update(_run_group(3, jobs_b, tmp / "log-b"))
    return {"tmp": tmp, "src": src, "ref": ref, "out": {**{j["name"]: a / j["name"] for j in jobs_a},
                                                      **{j["name"]: b / j["name"] for j in jobs_b},
                                                      "resumed": tmp / "killed"},
            "logs": logs, "killed_state": killed_state}


def _same_bytes(one: Path, many: Path) -> None:
    assert tree_state(one) == tree_state(many), f"{many} differs from {one}"


@pytest.mark.parametrize("name", [f"{r}-{s}" for r, s in GROUP_A + GROUP_B] + ["relayout", "dequantize"] + [
    pytest.param(n, marks=pytest.mark.skipif(not CALIBRATE, reason="needs the calibrate extra"))
    for n in ("calibrated-llama", "calibrated-search", "calibrated-moe")])
@pytest.mark.slow
def test_ranks_write_the_bytes_of_one_process(runs, name):
    logs = runs["logs"][name]
    assert sorted(logs) == list(range(len(logs))) and len(logs) in (2, 3)
    assert all(rec["code"] == 0 and rec["err"] == "" for rec in logs.values()), logs
    _same_bytes(runs["ref"] / name, runs["out"][name])


def test_every_recipe_runs_on_several_ranks():
    from quantcli.recipes import RECIPES

    assert {r for r, _ in GROUP_A + GROUP_B} == set(RECIPES)


@pytest.mark.slow
def test_a_fused_group_split_over_ranks_gets_one_global_scale(runs):
    """The llama source deals q/k/v over shards that LPT gives to different ranks (2 and 3)."""
    from quantcli.checkpoint.source import open_source
    from quantcli.planning.conversion import plan_conversion
    from quantcli.planning.options_file import conversion_options

    plan = plan_conversion(open_source(str(runs["src"]["llama"])), conversion_options(
        recipe="nvfp4", layout=None, ignore=[], config=None, scale_rule=None))
    sizes: dict[str, int] = {}
    for t in plan.tensors:
        sizes[t.shard] = sizes.get(t.shard, 0) + t.bytes_in
    for ranks in (2, 3):
        owner = assign_largest_first(sizes, ranks)
        split = [g for g, members in plan.fused_groups().items() if len({owner[t.shard] for t in members}) > 1]
        assert split, f"no fused group spans ranks with {ranks} ranks"
    out = runs["out"]["nvfp4-llama"]
    scales = {}
    for f in out.glob("*.safetensors"):
        scales.update({n: v for n, v in load_file(f).items() if n.endswith("self_attn.q_proj.weight_scale_2")
                       or n.endswith("self_attn.k_proj.weight_scale_2")})
    assert len(scales) == 4 and torch.equal(scales["model.layers.0.self_attn.q_proj.weight_scale_2"],
                                            scales["model.layers.0.self_attn.k_proj.weight_scale_2"])


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_and_resume_on_other_ranks_finishes_it(runs):
    killed = runs["logs"]["killed"]
    assert list(killed) == [0], "rank 1 was killed before it could log"
    code, err = killed[0]["code"], killed[0]["err"]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "rank 1 stopped responding" in lines[0] and "--resume" in lines[0], err
    state = runs["killed_state"]
    assert ".quantcli-progress.json" in state and any(".rank1." in n for n in state), state
    assert sum(n.endswith(".safetensors") for n in state) >= 2  # rank 0's shards and rank 1's first
    resumed = runs["logs"]["resumed"]
    assert all(rec["code"] == 0 for rec in resumed.values()), resumed
    _same_bytes(runs["ref"] / "nvfp4-llama", runs["out"]["resumed"])


@pytest.mark.slow
def test_a_refusal_on_one_rank_refuses_the_job_and_leaves_nothing(runs):
    logs = runs["logs"]["refused"]
    assert sorted(logs) == [0, 1, 2] and all(rec["code"] == 2 for rec in logs.values()), logs
    for rec in logs.values():
        lines = [ln for ln in rec["err"].splitlines() if ln.strip()]
        assert len(lines) == 1 and "o_proj" in lines[0], rec
    assert_nothing_left(runs["tmp"] / "refused")


@pytest.mark.slow
def test_workers_option_spawns_the_ranks_itself(runs, run_cli):
    out = runs["tmp"] / "workers"
    code, _, err = run_cli("convert", runs["src"]["llama"], out, "--recipe", "fp8-block", "--workers", "2",
                           "--device", "cpu", "--quiet")
    assert code == 0, err
    _same_bytes(runs["ref"] / "fp8-block-llama", out)


def test_lpt_split_is_balanced_and_stable():
    sizes = {"a": 10, "b": 7, "c": 6, "d": 5, "e": 4}
    owner = assign_largest_first(sizes, 2)
    loads = [sum(n for s, n in sizes.items() if owner[s] == r) for r in range(2)]
    assert owner == assign_largest_first(dict(reversed(sizes.items())), 2) and sorted(loads) == [15, 17]


def test_merged_calibration_stats_are_the_max_and_leave_unreached_experts_absent():
    """Two ranks in threads, meeting through a barrier: each max is the larger one, a module one
    rank reached is there for both, and an expert no rank reached stays absent (so quantcli/calibrate/scales.py
    fills it from its block, as in one process)."""
    import threading

    from quantcli.calibrate.engine import Stats
    from quantcli.calibrate.run import merged_stats

    ranks = [Stats(inputs={"a": 1.0, "e0": 2.0}, keys={"attn": 0.5}, values={"attn": 3.0}, channel_stats=False,
                   expert_roles={"e0": "x:down", "e1": "x:down", "e2": "x:down"}),
             Stats(inputs={"a": 4.0, "e1": 0.25}, keys={"attn": 0.75}, values={"attn": 1.0}, channel_stats=False,
                   expert_roles={"e0": "x:down", "e1": "x:down", "e2": "x:down"})]
    barrier, posted, out = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int) -> None:
        def share(value):
            posted[r] = value
            barrier.wait()
            both = list(posted)
            barrier.wait()
            return both

        def all_max(t):
            posted[r] = t
            barrier.wait()
            m = torch.maximum(posted[0], posted[1])
            barrier.wait()
            return m

        out[r] = merged_stats(ranks[r], share, all_max)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for merged in out:
        assert merged.inputs == {"a": 4.0, "e0": 2.0, "e1": 0.25}
        assert merged.keys == {"attn": 0.75} and merged.values == {"attn": 3.0}
        assert merged.expert_roles["e2"] == "x:down"
