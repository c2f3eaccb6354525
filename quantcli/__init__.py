"""quantcli: quantize and convert Hugging Face safetensors checkpoints (FP8, MXFP8, MXFP4, NVFP4)."""

import os

# MKL's strict conditional numerical reproducibility: its GEMM and triangular solves then give the
# same bits whatever the operands' memory alignment and the instruction set it picks (measured:
# tests/test_gptq_pins.py, pinned on another machine, holds on an AVX-512 one only with it, and
# then with MKL held to AVX2 or AVX-512 alike; no slower on GPTQ's shapes; docs/gptq.md,
# "Reproducible to the byte"). MKL reads it at its first call, so
# it is set on import, before any matmul; a value the user set wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
