"""Data-aware rounding: which codes a recipe writes when calibration inputs are known (GPTQ,
gptq.py), built from the recipe's own quantizer taken apart per span of columns (spans.py)."""
