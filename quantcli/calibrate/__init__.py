"""Calibration: static activation scales (NVFP4 W4A4, FP8) and FP8 KV-cache scales from data.

quantcli/planning/calibration.py (`checked_plan`) refuses what cannot be calibrated before any work and
adds the tensors a calibrated run writes to the plan; quantcli/model/samples.py reads the calibration samples;
`engine.py` runs the source model one decoder layer at a time (transformers, built on the meta
device, weights read through quantcli's reader) and records max |input| per Linear and max
|key| (after rotary) / max |value| per attention layer; `scales.py` turns them into ModuleFacts
(convert/passes/fact_passes.py runs it as a fact pass). transformers is the optional extra
`calibrate` (its packages: model/samples.py extra_hint).
"""
