"""A real weight pass for the tests of the seam (quantcli/convert/passes): it rounds each Linear to
nearest with its recipe's own quantizer, the very call the shard job makes, so a conversion with
it must be byte-identical to a plain one; and it keeps what the seam handed it (the statistics)
so that the tests can compare them across runs and ranks.

`install()` registers it where data-aware rounding will register (WEIGHT_PASSES), in this process;
`main()` does so and runs the command line (a subprocess or a spawned rank). `reference_statistics`
and `decoded` are what the tests hold the statistics to: transformers' own forward, no quantcli code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from quantcli.model.threads import walk_threads

STATISTICS_ENV = "QUANTCLI_TEST_STATISTICS"  # a folder: each module's statistic is saved there


class NearestPass:
    name = "nearest-test"

    def __init__(self, negate: frozenset[str] = frozenset()):
        self.negate = negate  # modules rounded from -W: a product the shard job could not have made itself
        self.rounded: list[str] = []
        self.statistics: dict[str, tuple[torch.Tensor, int]] = {}

    def takes(self, plan, t) -> bool:
        return True

    def feeds_quantized(self, plan) -> bool:
        return True

    def matmul_dtype(self, plan):
        return None  # the layers in FP32, as GPTQ's default

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double()  # products of FP32 values are exact in FP64; their sums are what the order fixes
        return x.T @ x

    def quantize(self, work):
        module = work.tensor.module
        self.rounded.append(module)
        if work.statistic is not None:
            self.statistics[module] = (work.statistic.cpu().clone(), work.tokens)
            folder = os.environ.get(STATISTICS_ENV)
            if folder:
                from safetensors.torch import save_file

                save_file({"statistic": work.statistic.cpu().contiguous(), "tokens": torch.tensor(work.tokens)},
                          str(Path(folder) / f"{module}.safetensors"))
        w = -work.weight if module in self.negate else work.weight
        return work.recipe.quantize(work.tensor.name, w, backend=work.backend, facts=work.facts)


def reference_statistics(model, layer: str, inputs: list[dict],
                         weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum over `inputs` (each one forward's keyword arguments, in order) of X^T X in FP64 for every
    Linear under the module path `layer` of the FP32 transformers `model`, whose modules named in
    `weights` hold those weights ({module: weight}; the model's parameter names are the checkpoint's)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for module, w in weights.items():
            params[f"{module}.weight"].copy_(w)
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = x.T @ x if name not in sums else sums[name] + x.T @ x
        return record

    hooks = [m.register_forward_pre_hook(hook(f"{layer}.{n}")) for n, m in model.get_submodule(layer).named_modules()
             if isinstance(m, torch.nn.Linear)]
    # the walk runs small batches on one intra-op thread (model/threads.py walk_threads): the same
    # thread count here, so the FP32 forward, and X, are the same bits
    rows = sum(kw["input_ids"].numel() for kw in inputs) / max(1, len(inputs))
    with torch.no_grad(), walk_threads(torch.device("cpu"), rows, model.config.to_dict()):
        for kwargs in inputs:
            model(**kwargs)
    for h in hooks:
        h.remove()
    return sums


def decoded(run_cli, out: Path, dense: Path, modules: list[str]) -> dict[str, torch.Tensor]:
    """Each module's weight decoded from the written checkpoint `out` (dequantized to FP32 by
    convert into `dense`)."""
    from safetensors.torch import load_file

    assert run_cli("convert", str(out), str(dense), "--recipe", "fp32", "--quiet")[0] == 0
    found = {}
    for f in dense.glob("*.safetensors"):
        found.update({n.removesuffix(".weight"): t for n, t in load_file(f).items()
                      if n.removesuffix(".weight") in modules})
    assert sorted(found) == sorted(modules)
    return found


def install(wp: NearestPass | None = None) -> NearestPass:
    import quantcli.convert.passes as passes

    wp = wp or NearestPass()
    passes.WEIGHT_PASSES = (wp,)
    return wp


def main(argv: list[str]) -> None:
    install()
    from quantcli.cli.app import main as cli_main

    sys.argv = ["quantcli", *argv]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
