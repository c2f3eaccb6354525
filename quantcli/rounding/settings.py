"""GPTQ's settings and their allowed values, apart from the solver so that the command line can
declare its --gptq-* options without loading torch (planning/rounding.py)."""

from __future__ import annotations

from dataclasses import dataclass

DAMPENING = 0.01  # GPTQ paper, llm-compressor's dampening_frac
BLOCK_COLUMNS = 128  # lazy batch updates (GPTQ paper, llm-compressor's block_size)
MAX_DAMPENING = 1.0
ACT_ORDERS = ("none", "static")
SCALE_CHOICES = ("updated", "original")


@dataclass(frozen=True)
class GptqSettings:
    dampening: float = DAMPENING
    act_order: str = "static"  # static | none (measured on all-MiniLM-L6-v2: docs/gptq.md)
    scales: str = "updated"  # updated | original (block formats; see rounding/gptq.py's docstring)
    block_columns: int = BLOCK_COLUMNS
