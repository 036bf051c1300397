"""8-bit storage of the frozen base: float8 e4m3 weights with a per-output-channel scale, computed in the
training dtype (bf16 on GPUs). Only the Linear layers inside the transformer blocks are stored in 8 bits;
embeddings, norms, the output projection and the LoRA weights keep their precision.

`Float8Linear` subclasses `nn.Linear`, so peft wraps it with LoRA like any Linear. Used for
`memory.base_quant` fp8 (rtx5090) and qfloat8 (rtx4090: the same e4m3 format optimum-quanto's qfloat8 uses).
`memory.base_quant: nf4` stores the same layers as bitsandbytes 4-bit NormalFloat (blocks of 64 with an absmax
each, ~0.55 byte/parameter), which peft's bitsandbytes LoRA layers wrap.

`memory.compute: fp8` (sm_89+: Ada, Hopper, Blackwell) also multiplies in 8 bits: each block Linear's input is
rounded to e4m3 with a scale per token and multiplied by the e4m3 weight in one `torch._scaled_mm` (both scales
applied to the output); the gradient for the input is the same product with the
incoming gradient rounded to e5m2 per token and the weight kept a second time, transposed (2 bytes/parameter in
all, as bf16) — or, over an 8-bit base, multiplied in bf16 by the dequantized weight (1 byte/parameter). Both
8-bit products use Hopper's fast accumulation: at FLUX's shapes it adds ~0.3% relative error against the 2.5%
(e4m3) and 5% (e5m2) of the rounding itself (H100, 2026-11-24, benchmarks-history.md), with held-out loss parity measured
(docs/benchmarks-history.md, Performance V). The weights are frozen, so no weight gradient is computed; LoRA's own matmuls stay in
bf16 with fp32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorakit.io.staging import staged
from lorakit.models.native import in_block

E4M3_MAX = 448.0


class Float8Linear(torch.nn.Linear):
    """A frozen Linear whose weight lives in float8_e4m3fn (1 byte/parameter) plus a float32 scale per row."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype, device=None, add=(),
                 compute: str = "bf16", transposed: bool = False, moved: tuple | None = None):
        """`add`: low-rank changes (B, A, coefficient) summed into the weight in float32 before it is rounded
        to 8 bits (inference with LoRAs: one pass over the weight). `compute`: "bf16" (dequantize, multiply in
        the compute dtype) or "fp8" (`torch._scaled_mm`, see the module notes); `transposed`: with fp8, keep the
        transposed weight too so the input's gradient is an fp8 product as well. `moved`: the layer's (weight,
        bias) already copied to `device` (`io.staging`), used in place of the layer's own."""
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = moved or (linear.weight, linear.bias)
        w = weight.detach().to(device)  # device None: where the layer is
        if add:
            w = w.float()
            for B, A, coef in add:
                w.addmm_(B.to(w), A.to(w), alpha=coef)
        w8, scale = rounded_rows(w)
        self.weight = torch.nn.Parameter(w8, requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(
            bias.detach().to(device=device, dtype=compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype
        self.compute = compute
        self.register_buffer("weight_t", self.weight.data.t().contiguous() if compute == "fp8" and transposed
                             else None, persistent=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight.to(self.compute_dtype) * self.scale[:, None].to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.compute == "fp8":
            y = fp8_linear(x, self.weight, self.scale, self.weight_t)
        else:
            y = dequant_linear(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias


ROUND_VALUES = 1 << 24  # values rounded at a time (64 MiB of float32 temporaries)


def rounded_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) as float8 e4m3 with a float32 scale per row (its absmax at e4m3's largest value), rounded
    ROUND_VALUES at a time: the float32 temporaries are the same few sizes whatever the layer, so a GPU's
    allocator reuses them layer after layer instead of asking for the weight's size in float32 three times
    over (12 bytes per parameter on a card the 8-bit base is filling). Each row as `(w.float() / scale)`."""
    rows = max(1, ROUND_VALUES // max(w.shape[1], 1))
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], rows):
        part = w[i:i + rows].float()
        s = part.abs().amax(dim=1).clamp_(min=1e-12).div_(E4M3_MAX)
        scale[i:i + rows] = s
        out[i:i + rows] = part / s[:, None]  # not in place: part may be w itself (float32 rows)
    return out, scale


def dequant_linear(x, w8, scale):
    """y = (x W8^T) * s in x's dtype (the row scale on the output: one weight-sized temporary, not two), with the
    input's gradient from the 8-bit weight (`_DequantMatmul`): autograd through F.linear would keep each layer's
    dequantized copy alive until backward (2 bytes/parameter of every block not recomputed)."""
    y = F.linear(x.detach(), w8.to(x.dtype)) * scale.to(x.dtype)
    return _DequantMatmul.apply(x, y, w8, scale)


class _DequantMatmul(torch.autograd.Function):
    """`y`, the product `dequant_linear` computed from x outside autograd, as an output of x whose gradient is
    g W, saving only the 8-bit weight. An autograd.Function, not an opaque operator: compiled, the cast and scale
    fuse into the block (an operator of its own was measured 0.736 -> 1.129 s per Qwen-Image step under the rtx4090
    profile, from its per-call host cost). Its forward holds no computation (see `_Fp8Matmul`)."""

    @staticmethod
    def forward(ctx, x, y, w8, scale):
        ctx.save_for_backward(w8, scale)
        return y.detach()  # y itself, as a tensor of its own (not a view: the block may change it in place)

    @staticmethod
    def backward(ctx, grad):
        w8, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _dequant_input_grad(grad, w8, scale), None, None, None


def _dequant_input_grad(grad, w8, scale):
    """g W for W = diag(scale) W8, in grad's dtype: the row scale on g's columns, then one product with the
    8-bit weight cast up (no dequantized weight kept).

    The cast is of the transposed weight (the same values): in a compiled block, a cast identical to the
    forward's is merged with it, and the partitioner then kept the cast bf16 weights of every block that does
    not recompute until backward (2 bytes/parameter each: past the memory plan of the 24/32 GB profiles —
    Qwen-Image under a 32 GiB cap ran out of memory). Cast here, in backward only, from the 8-bit weight."""
    return (grad * scale.to(grad.dtype)) @ w8.t().to(grad.dtype).t()


def _per_row(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, K) rounded to an 8-bit float with one float32 scale per row (its absmax at the format's maximum)."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.float() / scale).to(dtype), scale


def fp8_linear(x, w8, w_scale, w8_t=None):
    """y = x W^T with x rounded to e4m3 per token and W stored as e4m3 with a scale per output row (one
    `torch._scaled_mm`), the input's gradient from `_Fp8Matmul`."""
    rows = x.detach().reshape(-1, x.shape[-1])
    x8, x_scale = _per_row(rows, torch.float8_e4m3fn)
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.float()[None, :], out_dtype=x.dtype,
                         use_fast_accum=True)
    return _Fp8Matmul.apply(x, y.reshape(*x.shape[:-1], w8.shape[0]), w8, w_scale, w8_t)


class _Fp8Matmul(torch.autograd.Function):
    """`y`, the product `fp8_linear` computed from x outside autograd, as an output of x whose gradient is g W
    (g rounded to e5m2 per token) when the transposed weight is kept, else in the compute dtype. No gradient for
    the frozen weight.

    The forward holds no computation: where a compiled block recomputes in its backward graph
    (memory.compiled_recompute), PyTorch 2.11's compiler left the operations inside an autograd.Function's forward
    untagged for recompute, and its partitioner then kept every block's 8-bit products from forward to backward
    (Qwen-Image 1024², rtx4090 profile, one H200, 2026-12-01: 245.6 MiB a block, peak 33.8 GiB against 21.4)."""

    @staticmethod
    def forward(ctx, x, y, w8, w_scale, w8_t):
        ctx.save_for_backward(w8, w_scale, w8_t)
        ctx.dtype = x.dtype
        return y.detach()  # y itself, as a tensor of its own (not a view: the block may change it in place)

    @staticmethod
    def backward(ctx, grad):
        w8, w_scale, w8_t = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if w8_t is None:  # over an 8-bit base: the product in the compute dtype
            return _dequant_input_grad(grad.to(ctx.dtype), w8, w_scale), None, None, None, None
        g = grad.reshape(-1, grad.shape[-1]).float() * w_scale  # W = diag(s) W8: the scale goes on g's columns
        # e5m2, not e4m3: e4m3 halves the product's error but loses a row's values below ~2^-15 of its largest,
        # and its one parity run ended 2.9% above bf16 at step 300 (e5m2's: 0.5% below; docs/benchmarks-history.md)
        g8, g_scale = _per_row(g, torch.float8_e5m2)
        ones = torch.ones(1, w8.shape[1], device=g.device, dtype=torch.float32)
        gx = torch._scaled_mm(g8, w8_t.t(), scale_a=g_scale, scale_b=ones, out_dtype=ctx.dtype, use_fast_accum=True)
        return gx.reshape(*grad.shape[:-1], w8.shape[1]), None, None, None, None


def block_linears(transformer) -> list[str]:
    """The Linear layers `quantize_blocks` stores in 8 bits: those inside the transformer blocks."""
    return [n for n, m in transformer.named_modules() if type(m) is torch.nn.Linear and in_block(n)]


def quantize_blocks(transformer, compute_dtype: torch.dtype, device=None, add: dict | None = None,
                    compute: str = "bf16", transposed: bool = False, stats: dict | None = None,
                    host: tuple[str, ...] = ()) -> int:
    """Replace every Linear inside the transformer blocks by a Float8Linear, one layer at a time on `device`
    (default: where the layer is). A base loaded to the CPU thus reaches the GPU already in 8 bits: a 12 B
    transformer never needs its 24 GB bf16 form on a 24 GB card. `add`: module name -> low-rank changes
    summed in first; `compute`, `transposed`: as `Float8Linear` (layers whose sides are not multiples
    of 16 multiply in bf16). Layers on the CPU (a mapped checkpoint) reach a GPU through pinned memory, the next
    layers copied there by a worker while this one is rounded (`io.staging`; `stats` gets its "waited_s").
    Returns how many layers."""
    add = add or {}
    targets = block_linears(transformer)
    unknown = set(add) - set(targets)
    if unknown:
        raise ValueError(f"changes for layers that are not block Linears: {sorted(unknown)[:3]}")
    host = tuple(h + "." for h in host)
    layers = [transformer.get_submodule(name) for name in targets]
    moved = None
    if device is not None and torch.device(device).type != "cpu":
        moved = staged((t for lin in layers for t in (lin.weight, lin.bias)), device, stats=stats)
    try:
        for name, lin in zip(targets, layers, strict=True):
            parent_name, _, child = name.rpartition(".")
            fits = lin.in_features % 16 == 0 and lin.out_features % 16 == 0  # what the fp8 matrix units take
            q = Float8Linear(lin, compute_dtype, device, add.get(name, ()), compute if fits else "bf16", transposed,
                             moved=(next(moved), next(moved)) if moved else None)
            if host and name.startswith(host):
                q = q.to("cpu")
            setattr(transformer.get_submodule(parent_name), child, q)
    finally:
        if moved:
            moved.close()  # the worker's copies in hand finish and are dropped
    return len(targets)


def quantize_blocks_nf4(transformer, compute_dtype: torch.dtype, device=None) -> int:
    """Replace every Linear inside the transformer blocks by a bitsandbytes nf4 Linear4bit, quantized on
    `device` one layer at a time (as `quantize_blocks`). Returns how many layers."""
    import bitsandbytes as bnb

    targets = [(n, m) for n, m in transformer.named_modules()
               if type(m) is torch.nn.Linear and in_block(n)]
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
