"""LoRA files as `lorakit train` writes them, with non-zero B (every delta acts), for the convert/infer tests."""

from __future__ import annotations

import torch


def trained_like(tiny, family: str, path, targets="all_linear", alpha: float = 8, rank: int = 4, scale: float = 1.0,
                 seed: int = 0, dora: bool = False, io: bool = False):
    """Write a LoRA for the tiny model of `family` to `path` through `train.lora.save_lora`; returns the path."""
    from peft import LoraConfig

    import lorakit.train.lora as tl
    from lorakit.io.modules import load_component
    from lorakit.models.base import family_adapter

    tr = load_component(tiny(family) / "transformer")
    names = tl.target_modules(tr, family_adapter(family), targets, io=io)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, init_lora_weights="gaussian", use_dora=dora)
    tr.add_adapter(cfg)
    g = torch.Generator().manual_seed(seed)
    for n, p in tr.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g) * scale
        elif "lora_magnitude_vector" in n:
            p.data = p.data * (1 + 0.1 * torch.randn(p.shape, generator=g))
    tl.save_lora(tr, path, family)
    return path
