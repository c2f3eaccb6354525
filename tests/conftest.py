import os
import sys

import torch

# Without a CUDA device the Triton kernels run on the CPU through the interpreter; with one they
# are compiled and run on the GPU (tests/test_kernels.py then holds the compiled kernels to the
# torch reference). triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. when
# kernels/triton_quant.py is imported, so it is settled here before any test imports that.
# Importing torch first is safe: triton's knobs read the variable lazily, and torch loads no
# kernel module (the assert). An explicit TRITON_INTERPRET in the environment wins.
assert "quantcli.kernels.triton_quant" not in sys.modules, "the kernels were decorated before conftest ran"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from quantcli.testing import make_llama, make_moe  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("src") / "llama", hidden=128, layers=2, shards=2)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("src") / "moe", hidden=64, layers=2, shards=2)


@pytest.fixture(scope="session")
def one_shard_moe(tmp_path_factory) -> Path:
    """One MoE layer in one shard, in a folder named `moe`."""
    return make_moe(tmp_path_factory.mktemp("nc") / "moe", hidden=64, layers=1, shards=1)


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run `quantcli ARGS` through main() (so errors print as one line) -> (exit code, stdout, stderr)."""
    from quantcli.cli.app import main

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", ["quantcli", *map(str, args)])
        with pytest.raises(SystemExit) as exc:
            main()
        out = capsys.readouterr()
        return exc.value.code or 0, out.out, out.err

    return run


@pytest.fixture
def whole_batches(monkeypatch):
    """Call it to make the GPTQ walk run every batch of its observed runs whole from then on (no
    early stop: convert/passes/weight_walk.py), for comparing the bytes with and without the stop."""
    from quantcli.convert.passes.weight_walk import WeightWalk

    def apply() -> None:
        real = WeightWalk.batch_done

        def batch_done(self, j):
            real(self, j)
            self.first_batch = True  # as before the first batch: the next one runs whole

        monkeypatch.setattr(WeightWalk, "batch_done", batch_done)

    return apply
