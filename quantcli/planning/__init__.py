"""Planning: what a conversion will write, from headers alone. `conversion.plan_conversion` is the
one entry point (it picks the dense planner, `plan.make_plan`, or the one for quantized sources,
`from_quantized`); `options_file` reads a TOML recipe file into the options; `calibration` adds
the calibrated scale tensors to a plan."""
