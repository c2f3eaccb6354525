"""quantcli: quantize and convert Hugging Face safetensors checkpoints (FP8, MXFP8, MXFP4, NVFP4)."""

__version__ = "0.1.0"
