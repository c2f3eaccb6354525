"""The bytes layer: a checkpoint's files as they are on disk (the source folder, file or Hub repo,
safetensors headers and tensors, the JSON config files, quantcli's manifest). It knows nothing of
recipes or layouts."""
