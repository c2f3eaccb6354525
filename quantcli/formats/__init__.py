"""What a checkpoint's tensors mean: the layouts' on-disk tables, detection of a layout and its
recipes, decoding, module-name patterns, fused groups, MoE expert stacks, calibrated scales, the
engines that load each pair and the model card that says so."""
