"""The dtype names configs and command options use (bf16 | fp16 | fp32)."""

from __future__ import annotations

NAMES = ("bf16", "fp16", "fp32")


def torch_dtype(name: str):
    """bf16 | fp16 | fp32 -> the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
