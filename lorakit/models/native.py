"""The original (Black Forest Labs / ComfyUI / kohya) weight names of an architecture <-> diffusers' names, for
whole checkpoints: a diffusers state dict to the weights ComfyUI's model holds, and an original single-file
checkpoint back to diffusers' names. The names are each architecture's facts (`Adapter.native_names`); fused
weights (FLUX's img_attn.qkv = to_q|to_k|to_v, single blocks' linear1 = to_q|to_k|to_v|proj_mlp) split and
concatenate by rows, FLUX's final-norm halves are swapped, its RMSNorm `scale` is diffusers' `weight`.
`lorakit.convert.native` builds the LoRA-patch conversions on the same functions."""

from __future__ import annotations

import re

from lorakit.errors import FileFormatError
from lorakit.models.base import arch_adapter


def flat(name: str) -> str:
    return name.replace(".", "_")


def n_blocks(names) -> int:
    """1 + the largest block index in module names (0 when none has one): `...blocks.N`, `layers.N`, `..._refiner.N`
    (Z-Image's), with '.' or '_' around."""
    idx = [int(m.group(1)) for n in names for m in [re.search(r"(?:blocks|layers|refiner)[._](\d+)(?:[._]|$)", n)]
           if m]
    return max(idx) + 1 if idx else 0


_IN_BLOCK = re.compile(r"(?:^|\.)[A-Za-z_]*(?:blocks|layers|refiner)\.\d+\.")


def in_block(name: str) -> bool:
    """Is this module or weight name inside one of the transformer's repeated blocks (`transformer_blocks.3.`,
    `single_transformer_blocks.0.`, Z-Image's `layers.12.` and `noise_refiner.1.`)?"""
    return bool(_IN_BLOCK.search(name))


def block_of(name: str) -> str | None:
    """The name of the repeated block a module or weight name is inside (`transformer_blocks.3`), None outside."""
    m = _IN_BLOCK.search(name)
    return name[:m.end() - 1] if m else None


def native_table(arch: str, blocks: int, flat_names: bool = False) -> dict:
    """native name (kohya: '_' for '.') -> its `NativeName` record, for blocks 0 .. blocks-1."""
    table = arch_adapter(arch).native_table(max(blocks, 1))
    return {flat(k): v for k, v in table.items()} if flat_names else table


def identity_arch(arch: str) -> bool:
    return arch_adapter(arch).native_is_diffusers


def swap_halves(t):
    """Exchange the two halves of the rows (FLUX's final norm: [scale, shift] <-> [shift, scale])."""
    import torch

    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0).contiguous()


def row_sizes(rec, out_rows: int, in_features: int) -> list[int]:
    """How the fused weight's output rows divide among the record's targets."""
    k = len(rec.targets)
    if rec.split == "qkv_mlp":  # FLUX linear1: q, k, v (the input width each) then the MLP input
        return [in_features] * 3 + [out_rows - 3 * in_features]
    if out_rows % k:
        raise FileFormatError(f"{rec.native}: fused weight of {k} projections has {out_rows} output rows")
    return [out_rows // k] * k


def native_weights(sd: dict, arch: str) -> dict:
    """A diffusers state dict -> the original checkpoint's weights ("diffusion_model.<native>.<param>"): fused
    rows concatenated, swapped halves swapped, FLUX's norm scales renamed — what ComfyUI's model holds."""
    import torch

    table = native_table(arch, n_blocks(sd))
    out, used = {}, set()
    for native, rec in table.items():
        for param, dparam in ((rec.param, "weight"), ("bias", "bias")):
            parts = [sd.get(f"{t}.{dparam}") for t in rec.targets]
            if any(p is None for p in parts):
                continue
            w = torch.cat(parts) if len(parts) > 1 else parts[0]
            out[f"diffusion_model.{native}.{param}"] = swap_halves(w) if rec.swap_halves else w
            used.update(f"{t}.{dparam}" for t in rec.targets)
    if identity_arch(arch):
        out.update({f"diffusion_model.{k}": v for k, v in sd.items() if k not in used})
    return out


def diffusers_weights(sd: dict, arch: str) -> tuple[dict, list[str]]:
    """An original checkpoint's weights (no prefix) -> diffusers names: fused rows split (views, no copy), swapped
    halves swapped back, norm scales renamed. Keys no record names pass through unchanged (the identity
    architectures' names are diffusers' already); the caller checks the result against the model.

    Returns:
        (the diffusers state dict, the keys that passed through unchanged).

    Raises:
        FileFormatError: a fused weight whose rows do not divide as the architecture fuses them.
    """
    table = native_table(arch, n_blocks(sd))
    out, used, widths = {}, set(), {}
    for native, rec in table.items():  # weights first: a fused bias splits by its weight's input width
        for param, dparam in ((rec.param, "weight"), ("bias", "bias")):
            t = sd.get(f"{native}.{param}")
            if t is None:
                continue
            used.add(f"{native}.{param}")
            if rec.swap_halves:
                t = swap_halves(t)
            if dparam == "weight" and t.dim() == 2:
                widths[native] = int(t.shape[1])
            if len(rec.targets) == 1:
                out[f"{rec.targets[0]}.{dparam}"] = t
                continue
            if rec.split == "qkv_mlp" and native not in widths:
                raise FileFormatError(f"{native}.{param}: a fused bias without its weight cannot be split")
            sizes = row_sizes(rec, int(t.shape[0]), widths.get(native, 0))
            if sum(sizes) != t.shape[0] or min(sizes) <= 0:
                raise FileFormatError(f"{native}.{param}: fused rows {t.shape[0]} do not split as {sizes}")
            start = 0
            for target, n in zip(rec.targets, sizes, strict=True):
                out[f"{target}.{dparam}"] = t[start:start + n]
                start += n
    passed = [k for k in sd if k not in used]
    out.update({k: sd[k] for k in passed})
    return out, passed


def dequantize_scaled_fp8(sd: dict) -> tuple[dict, dict]:
    """ComfyUI's scaled fp8 (`<layer>.weight` in fp8 beside its `<layer>.scale_weight`, `<layer>.scale_input`, a
    `scaled_fp8` marker) -> plain weights: weight x scale, in bf16; the scales and the marker left out.

    Returns:
        (the weights, what was done: {"scaled": weights multiplied, "inputs": scale_input values left out,
        "marker": whether the marker was there, "orphans": scale_weight keys with no weight beside them}).
    """
    import torch

    out, scaled = {}, 0
    for k, v in sd.items():
        if k == "scaled_fp8" or k.endswith((".scale_weight", ".scale_input")):
            continue
        scale = sd.get(k.removesuffix(".weight") + ".scale_weight") if k.endswith(".weight") else None
        if scale is not None:
            v = (v.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16)
            scaled += 1
        out[k] = v
    orphans = [k for k in sd if k.endswith(".scale_weight") and k.removesuffix(".scale_weight") + ".weight" not in sd]
    return out, {"scaled": scaled, "inputs": sum(k.endswith(".scale_input") for k in sd),
                 "marker": "scaled_fp8" in sd, "orphans": orphans}
