"""A real weight pass for the tests of the seam (quantcli/convert/passes): it rounds each Linear to
nearest with its recipe's own quantizer, the very call the shard job makes, so a conversion with
it must be byte-identical to a plain one; and it keeps what the seam handed it (the statistics)
so that the tests can compare them across runs and ranks.

`install()` registers it where data-aware rounding will register (WEIGHT_PASSES), in this process;
`main()` does so and runs the command line (a subprocess or a spawned rank)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

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
