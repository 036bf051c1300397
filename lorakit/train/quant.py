"""8-bit storage of the frozen base: float8 e4m3 weights with a per-output-channel scale, computed in the
training dtype (bf16 on GPUs). Only the Linear layers inside the transformer blocks are stored in 8 bits;
embeddings, norms, the output projection and the LoRA weights keep their precision.

`Float8Linear` subclasses `nn.Linear`, so peft wraps it with LoRA like any Linear. Used for
`memory.base_quant` fp8 (rtx5090) and qfloat8 (rtx4090: the same e4m3 format optimum-quanto's qfloat8 uses).
`memory.base_quant: nf4` stores the same layers as bitsandbytes 4-bit NormalFloat (blocks of 64 with an absmax
each, ~0.55 byte/parameter), which peft's bitsandbytes LoRA layers wrap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0


class Float8Linear(torch.nn.Linear):
    """A frozen Linear whose weight lives in float8_e4m3fn (1 byte/parameter) plus a float32 scale per row."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype, device=None, add=()):
        """`add`: low-rank changes (B, A, coefficient) summed into the weight in float32 before it is rounded
        to 8 bits (inference with LoRAs: one pass over the weight)."""
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(device).float()  # device None: where the layer is
        for B, A, coef in add:
            w.addmm_(B.to(w), A.to(w), alpha=coef)
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX)
        self.weight = torch.nn.Parameter((w / scale[:, None]).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(device=device, dtype=compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype

    def dequantized(self) -> torch.Tensor:
        return self.weight.to(self.compute_dtype) * self.scale[:, None].to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the row scale applied to the output (x W^T) * s, not to the weight: one weight-sized temporary
        y = F.linear(x.to(self.compute_dtype), self.weight.to(self.compute_dtype)) * self.scale.to(self.compute_dtype)
        return y if self.bias is None else y + self.bias


def block_linears(transformer) -> list[str]:
    """The Linear layers `quantize_blocks` stores in 8 bits: those inside the transformer blocks."""
    return [n for n, m in transformer.named_modules() if type(m) is torch.nn.Linear and "blocks." in n]


def quantize_blocks(transformer, compute_dtype: torch.dtype, device=None, add: dict | None = None) -> int:
    """Replace every Linear inside the transformer blocks by a Float8Linear, one layer at a time on `device`
    (default: where the layer is). A base loaded to the CPU thus reaches the GPU already in 8 bits: a 12 B
    transformer never needs its 24 GB bf16 form on a 24 GB card. `add`: module name -> low-rank changes
    summed in first (`Float8Linear`). Returns how many layers."""
    add = add or {}
    targets = block_linears(transformer)
    unknown = set(add) - set(targets)
    if unknown:
        raise ValueError(f"changes for layers that are not block Linears: {sorted(unknown)[:3]}")
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        setattr(parent, child, Float8Linear(getattr(parent, child), compute_dtype, device, add.get(name, ())))
    return len(targets)


def quantize_blocks_nf4(transformer, compute_dtype: torch.dtype, device=None) -> int:
    """Replace every Linear inside the transformer blocks by a bitsandbytes nf4 Linear4bit, quantized on
    `device` one layer at a time (as `quantize_blocks`). Returns how many layers."""
    import bitsandbytes as bnb

    targets = [(n, m) for n, m in transformer.named_modules()
               if type(m) is torch.nn.Linear and "blocks." in n]
    for name, lin in targets:
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.detach().to(compute_dtype), requires_grad=False, quant_type="nf4")
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.detach().to(compute_dtype), requires_grad=False)
        q = q.to(device or lin.weight.device)  # bitsandbytes quantizes when the weight is moved
        parent_name, _, child = name.rpartition(".")
        setattr(transformer.get_submodule(parent_name), child, q)
    return len(targets)
