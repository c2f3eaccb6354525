"""Which serving engines load each (recipe, layout) pair quantcli writes, and the SGLang
`--quantization` flag a pair needs. From the loader rules of vLLM 0.33 and SGLang 0.5.23 (see
docs/formats.md, "Which engine loads which pair"); every pair `layouts_for` allows has a row
(tests/test_push.py checks it). Used by the model card's serving commands."""

from __future__ import annotations

ENGINES = ("vLLM", "SGLang", "TensorRT-LLM", "transformers")  # every engine below, in the order listings use

LOADS_IN: dict[tuple[str, str], tuple[str, ...]] = {
    ("fp8", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
    ("fp8", "fp8"): ("vLLM", "SGLang"),
    ("fp8", "modelopt"): ("vLLM", "SGLang", "TensorRT-LLM"),  # quant_algo FP8: with static input scales only
    ("fp8-channel", "modelopt"): ("vLLM",),  # SGLang treats FP8_PER_CHANNEL_PER_TOKEN as unquantized
    ("fp8-channel", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
    ("fp8-block", "modelopt"): ("vLLM",),  # and only when N and K are multiples of 128
    ("fp8-block", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
    ("fp8-block", "fp8"): ("vLLM", "SGLang", "transformers"),
    ("mxfp8", "modelopt"): ("vLLM",),
    ("mxfp8", "compressed-tensors"): ("vLLM", "transformers"),
    ("mxfp8", "fp8"): ("SGLang",),  # SGLang's own quant_method: mxfp8
    ("mxfp4", "compressed-tensors"): ("vLLM", "transformers"),  # SGLang has no dense MXFP4 scheme
    ("mxfp4", "gpt-oss"): ("vLLM", "SGLang", "transformers"),  # MoE experts only
    ("nvfp4", "modelopt"): ("vLLM", "SGLang", "TensorRT-LLM"),
    ("nvfp4", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
    ("int8-channel", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
    # pack-quantized W4A16: vLLM compressed_tensors_wNa16.py::CompressedTensorsWNA16 (Machete on SM90,
    # Marlin SM75+), SGLang's CompressedTensorsWNA16 (Marlin, SM80+), transformers through
    # compressed-tensors' PackedQuantizationCompressor.decompress
    ("int4", "compressed-tensors"): ("vLLM", "SGLang", "transformers"),
}

# SGLang reads the method from the config; ModelOpt's NVFP4 checkpoints are documented (and
# served) with the explicit flag, which also selects its FP4 kernels.
SGLANG_FLAGS: dict[tuple[str, str], str] = {("nvfp4", "modelopt"): "modelopt_fp4"}


def loads_in(recipe: str, layout: str) -> tuple[str, ...]:
    """The engines that load `recipe` in `layout` unedited (empty for a pair quantcli refuses)."""
    return LOADS_IN.get((recipe, layout), ())


def sglang_flag(recipe: str, layout: str) -> str | None:
    """SGLang's `--quantization` value for the pair, or None where the config is enough."""
    return SGLANG_FLAGS.get((recipe, layout))
