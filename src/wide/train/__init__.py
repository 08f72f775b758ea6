"""Router calibration and LoRA recovery: the training loop, its state, FSDP."""
