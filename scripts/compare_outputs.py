"""Byte identity of `quantcli convert` outputs between two checkouts.

Builds tiny fixtures once (the NEW checkout's quantcli/testing.py: make_llama, make_moe,
make_gpt_oss, make_bert, two shards each but BERT, which transformers saves in one), a calibration
file per fixture (input_ids .jsonl for the decoders, which have no tokenizer; plain text .txt for
BERT, through its WordPiece tokenizer), then runs the same matrix of command lines on each checkout:
round to nearest (nvfp4, fp8-block, mxfp4 on their default layouts; the gpt-oss card on the
gpt-oss fixture), calibrated static activations (nvfp4 and fp8, with --kv-cache fp8 on the
decoders), and GPTQ (nvfp4; the gpt-oss card), each in one process and with --workers 2. Only
options both sides accept are used (a checkout with a top-level kernels/ package runs with shim()'s
folder before it on PYTHONPATH), and --calibration-samples is given explicitly (its default
changed from 128 to 512). Every output .safetensors tensor is then compared (name, dtype, shape,
raw bytes, read straight from the files' headers so that FP8 and packed dtypes need no torch), and
config.json's quantization_config, the other non-tensor files, and quantcli_manifest.json with its
version and fingerprint fields left out.

    python scripts/compare_outputs.py OLD_CHECKOUT NEW_CHECKOUT [--work DIR] [--only SUBSTR ...]
        [--threads N] [--keep]

e.g., from a scratch folder (each side runs as `PYTHONPATH=<checkout> python -m quantcli`):

    cd /tmp/ident-x && python /work/wt-identity/scripts/compare_outputs.py /work/wt-b663 /work/main

--threads N sets OMP_NUM_THREADS/MKL_NUM_THREADS for the conversions (default: unset, the
machine's own). A case one side refuses prints its exit code and last stderr line. Exit status:
0 when every case is identical on both sides (or refused by both), 1 otherwise.

Run at b663f11 against main e26662f (2 cores, default threads), the tensors differ in two places
only: the MoE's static calibration in one process (an expert's input_scale, 197debc's layer walk;
equal with --threads 1 or --workers 2) and BERT's GPTQ (a618af8's one-thread rule, deliberate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

IGNORED_MANIFEST_KEYS = {"version", "quantcli_version", "fingerprint", "fingerprints", "created", "created_at",
                         "timestamp", "seconds", "wall_s", "elapsed", "elapsed_s", "duration", "duration_s"}

FIXTURES = """
import json, sys
from pathlib import Path
from quantcli.testing import make_llama, make_moe, make_gpt_oss, make_bert
root = Path(sys.argv[1])
make_llama(root / "llama", hidden=128, layers=2, shards=2)
make_moe(root / "moe", hidden=64, layers=2, shards=2)
make_gpt_oss(root / "gpt-oss", hidden=64, layers=2, shards=2, sliding_window=8)
make_bert(root / "bert", hidden=64, layers=2)
ids = "".join(json.dumps({"input_ids": [(7 * i + 13 * j + 1) % 512 for j in range(10 + 3 * (i % 4))]}) + "\\n"
              for i in range(16))
(root / "ids.jsonl").write_text(ids)
words = ["the", "cat", "sat", "on", "a", "mat", "rain", "in", "north", "model", "is", "small", "and", "of", "to"]
text = "".join(" ".join(words[(3 * i + 5 * j) % len(words)] for j in range(6 + i % 5)) + " .\\n" for i in range(16))
(root / "sentences.txt").write_text(text)
"""


def cases(root: Path, card: Path) -> list[tuple[str, str, list[str]]]:
    """(fixture, label, options) for every command line of the matrix."""
    out = []
    for fx in ("llama", "moe", "gpt-oss", "bert"):
        data = str(root / ("sentences.txt" if fx == "bert" else "ids.jsonl"))
        calib = ["--calibration", data, "--calibration-samples", "16"]
        kv = [] if fx == "bert" else ["--kv-cache", "fp8"]
        for r in ("nvfp4", "fp8-block", "mxfp4"):
            out.append((fx, f"rtn {r}", ["--recipe", r]))
        if fx == "gpt-oss":
            out.append((fx, "rtn gpt-oss card", ["--config", str(card)]))
        out.append((fx, "static nvfp4", ["--recipe", "nvfp4", "--activations", "static", *kv, *calib]))
        out.append((fx, "static fp8", ["--recipe", "fp8", "--activations", "static", *kv, *calib]))
        out.append((fx, "gptq nvfp4", ["--recipe", "nvfp4", "--rounding", "gptq", *calib]))
        if fx == "gpt-oss":
            out.append((fx, "gptq gpt-oss card", ["--config", str(card), "--rounding", "gptq", "--gptq-min-tokens",
                                                  "1", *calib]))
    return out


def read_safetensors(path: Path) -> tuple[dict, dict]:
    """{name: (dtype, shape, raw bytes)} and the header's __metadata__."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {}) or {}
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, meta


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in IGNORED_MANIFEST_KEYS}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def json_diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        diffs = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                diffs.append(f"{path}.{k}: only new")
            elif k not in b:
                diffs.append(f"{path}.{k}: only old")
            else:
                diffs += json_diff(a[k], b[k], f"{path}.{k}")
        return diffs
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:80]} -> {json.dumps(b)[:80]}"]


def compare(old: Path, new: Path) -> dict:
    tensors, files = {}, {}
    for side, folder in (("old", old), ("new", new)):
        t, where, meta = {}, {}, {}
        for f in sorted(folder.glob("*.safetensors")):
            got, m = read_safetensors(f)
            t.update(got)
            where.update({k: f.name for k in got})
            meta[f.name] = m
        tensors[side] = (t, where, meta)
        files[side] = {p.name for p in folder.iterdir() if p.is_file()}
    (to, wo, mo), (tn, wn, mn) = tensors["old"], tensors["new"]
    names = sorted(set(to) | set(tn))
    same = [n for n in names if n in to and n in tn and to[n] == tn[n]]
    first = None
    for n in names:
        if n not in to or n not in tn:
            first = f"{n} (only {'new' if n in tn else 'old'})"
        elif to[n] != tn[n]:
            a, b = to[n], tn[n]
            why = "dtype" if a[0] != b[0] else "shape" if a[1] != b[1] else \
                f"bytes ({sum(x != y for x, y in zip(a[2], b[2]))}/{len(a[2])} differ)"
            first = f"{n} {why}"
        if first:
            break
    notes = []
    if same == names and any(wo[n] != wn[n] for n in names):
        notes.append("tensors placed in other shard files")
    if mo != mn:
        notes.append(f"safetensors metadata differs: {json.dumps(mo)[:100]} -> {json.dumps(mn)[:100]}")
    if files["old"] != files["new"]:
        notes.append(f"files only old {sorted(files['old'] - files['new'])}, only new "
                     f"{sorted(files['new'] - files['old'])}")
    for name in sorted(files["old"] & files["new"]):
        if name.endswith(".safetensors") or name == "quantcli_manifest.json":
            continue
        a, b = (old / name).read_bytes(), (new / name).read_bytes()
        if a == b:
            continue
        if name == "config.json":
            qa, qb = (json.loads(x).get("quantization_config") for x in (a, b))
            d = json_diff(qa, qb, "quantization_config")
            rest = json_diff({k: v for k, v in json.loads(a).items() if k != "quantization_config"},
                             {k: v for k, v in json.loads(b).items() if k != "quantization_config"}, "config")
            notes += d + rest or ["config.json differs in formatting only"]
        else:
            notes.append(f"{name} differs")
    mf = "quantcli_manifest.json"
    if mf in files["old"] and mf in files["new"]:
        d = json_diff(strip(json.loads((old / mf).read_text())), strip(json.loads((new / mf).read_text())), "manifest")
        if d:
            notes.append(f"manifest: {len(d)} difference(s): " + "; ".join(d[:4]))
    return {"same": len(same), "total": len(names), "first": first, "notes": notes}


def shim(work: Path) -> Path:
    """A folder whose only content is a `kernels` 0.0.1 dist-info: first on PYTHONPATH for a checkout with
    a top-level kernels/ package (before 626f68e), it makes transformers' is_kernels_available() False
    (the version is under its minimum), so transformers does not import Hugging Face's kernels package
    from the checkout's own kernels/ and fail (ImportError: CUDAProperties), as it does in a venv with
    kernels installed. Nothing of either checkout's code changes."""
    d = work / "shim" / "kernels-0.0.1.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n")
    return d.parent


def run(checkout: Path, argv: list[str], cwd: Path, threads: int | None) -> tuple[int, str]:
    path = [str(shim(cwd)), str(checkout)] if (checkout / "kernels" / "__init__.py").exists() else [str(checkout)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, "-m", "quantcli", *argv], cwd=cwd, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return p.returncode, lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--work", type=Path, default=Path.cwd() / "compare-work")
    ap.add_argument("--only", nargs="*", default=[], help="run the cases whose 'fixture options workers' has all these")
    ap.add_argument("--skip", nargs="*", default=[], help="leave out the cases whose key has any of these")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workers", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--keep", action="store_true", help="keep the outputs (default: removed once compared)")
    a = ap.parse_args()
    old, new, work = a.old.resolve(), a.new.resolve(), a.work.resolve()
    fx = work / "fixtures"
    if not (fx / "sentences.txt").exists():
        fx.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", FIXTURES, str(fx)], check=True, cwd=work,
                       env={**os.environ, "PYTHONPATH": str(new)})
    card = new / "recipes" / "examples" / "mxfp4-gpt-oss-experts.toml"
    print(f"{'fixture':8} {'options':18} {'w':>1}  {'identical':>10}  first differing tensor / notes", flush=True)
    bad = 0
    for i, (fixture, label, opts) in enumerate(cases(fx, card)):
        for workers in a.workers:
            key = f"{fixture} {label} {workers}"
            if a.only and not all(s in key for s in a.only) or any(s in key for s in a.skip):
                continue
            outs = {}
            codes = {}
            for side, checkout in (("old", old), ("new", new)):
                dst = work / "out" / side / f"{i}-{workers}"
                shutil.rmtree(dst, ignore_errors=True)
                argv = ["convert", str(fx / fixture), str(dst), *opts, "--device", "cpu", "--quiet"]
                if workers > 1:
                    argv += ["--workers", str(workers)]
                codes[side] = run(checkout, argv, work, a.threads)
                outs[side] = dst
            row = f"{fixture:8} {label:18} {workers:>1}"
            if codes["old"][0] or codes["new"][0]:
                ok = codes["old"][0] == codes["new"][0]
                bad += not ok
                print(f"{row}  {'refused' if ok else 'EXIT ' + str(codes['old'][0]) + '/' + str(codes['new'][0]):>10}"
                      f"  old: {codes['old'][1][:90]} | new: {codes['new'][1][:90]}", flush=True)
                continue
            r = compare(outs["old"], outs["new"])
            bad += r["same"] != r["total"] or bool(r["notes"])
            print(f"{row}  {r['same']:>4}/{r['total']:<5}  {r['first'] or '-'}"
                  + "".join(f"\n{'':34}note: {n}" for n in r["notes"]), flush=True)
            if not a.keep:
                for d in outs.values():
                    shutil.rmtree(d, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
