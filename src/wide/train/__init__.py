"""Router calibration and LoRA recovery: the training loop with its DCP state (loop) and FSDP2 (fsdp)."""
