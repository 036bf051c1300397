"""Conversions: LoRA layouts (lora.py), LoRA merging (merge.py)."""
