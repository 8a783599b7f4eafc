"""PEFT LoRA adapters merged into the dequantized weights."""
