"""How many intra-op threads a layer walk (calibration's, a weight pass's) runs on, on the CPU."""

from __future__ import annotations

import contextlib

import torch

from quantcli.model.stack import text_config

# Under this many multiply-adds in a batch's hidden x hidden matmul (~1 ms on one core) the walk
# runs on one intra-op thread on the CPU: such ops gained at most ~1.5x from a second thread on
# an idle 2-core machine and lost 3-20x on a shared one, where each op waits at the OpenMP barrier
# for the thread the scheduler took away (docs/gptq.md, "Threads"). Fixed by the model and the
# data, never by the load: the bytes depend on the thread count.
SMALL_BATCH_MACS = 2**24


@contextlib.contextmanager
def walk_threads(device, rows_per_batch: float, config: dict):
    """One intra-op thread for the walk where its batches are small (SMALL_BATCH_MACS), else as set.
    `rows_per_batch`: the calibration tokens over the batches."""
    hidden = int(text_config(config).get("hidden_size") or 0)
    previous = torch.get_num_threads()
    if device.type == "cpu" and hidden and rows_per_batch * hidden * hidden < SMALL_BATCH_MACS:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
