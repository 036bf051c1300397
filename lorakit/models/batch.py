"""What the transformer trains on: one batch of cached items (latents, text, controls, loss masks and weights)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Batch:
    keys: list[str]
    latents: object  # (B, C, h, w) or (B, C, T, h, w)
    text: dict  # prompt_embeds (B, L, D) [+ prompt_embeds_mask (B, L)] [+ pooled (B, D)]
    controls: list  # per control index: (B, C, h, w)
    mask: object = None  # loss mask (B, 1, [1,] h, w) when any item has one (the others: ones)
    weights: object = None  # per-item loss weight (B,) when a dataset has loss_weight != 1


def drop_full_mask(batch: Batch) -> Batch:
    """Leave out a text mask that masks nothing (every prompt of the batch has the same length).

    Attention with no mask is the same computation, and it lets PyTorch use the flash kernel, which refuses
    any mask (Qwen-Image passes its text mask into attention; at batch 1 it is always all ones).
    """
    mask = batch.text.get("prompt_embeds_mask")
    if mask is None or not bool(mask.all()):
        return batch
    return Batch(batch.keys, batch.latents, {k: v for k, v in batch.text.items() if k != "prompt_embeds_mask"},
                 batch.controls, batch.mask, batch.weights)
