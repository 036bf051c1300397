"""Writing a `Lora` in a format: `diffusers` / `peft` (alpha folded into B, so alpha == rank and every consumer
applies the same change; DoRA adds ComfyUI's `.dora_scale` beside peft's magnitudes) and `kohya` / `comfyui`
(native names, explicit `.alpha`, LyCORIS and difference keys kept). Native names and fused weights:
`convert/native.py`."""

from __future__ import annotations

import json
from pathlib import Path

from lorakit.convert.native import (
    dora_scale_order,
    fuse_biases,
    fuse_patches,
    swapped_modules,
)
from lorakit.convert.patches import Full, LoHa, LoKr, LowRank, Rows, kind_name
from lorakit.convert.read import Lora, magnitude_to_dora_scale
from lorakit.errors import InputError
from lorakit.io import atomic_path, save
from lorakit.models.base import arch_adapter
from lorakit.models.native import flat, n_blocks
from lorakit.models.registry import arch_names

FORMATS = ("diffusers", "peft", "kohya", "comfyui")


def write(lora: Lora, dst, fmt: str, arch: str | None, dtype=None, extra_metadata: dict | None = None,
          base: dict | None = None) -> Path:
    """Write a LoRA in a format (atomically). Returns the written path.

    Args:
        base: diffusers module -> base weight; needed for DoRA into ComfyUI's convention (`dora_scale`).

    Raises:
        InputError: the format cannot hold what the LoRA carries (named), or DoRA without the base weights.
    """
    if fmt not in FORMATS:
        raise InputError(f"--to must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dst = Path(dst)

    def cast(t):
        return t.to(dtype).contiguous() if dtype is not None and t.is_floating_point() else t.contiguous()

    meta = {"format": "pt", **({"lorakit_arch": arch} if arch else {}), **(extra_metadata or {})}
    lyco = [m for m, p in lora.weights.items() if isinstance(p, (LoKr, LoHa))]
    if fmt == "diffusers" and lyco and len(lyco) == len(lora.weights) and not lora.biases:
        # LyCORIS patches under diffusers module names (`transformer.<module>.lokr_w1`, `.hada_w1_a`): ComfyUI
        # maps these names onto its fused weights; peft names its LoKr/LoHa tensors the same way
        sd = {}
        for m, p in lora.weights.items():
            sd.update(_native_keys(f"transformer.{m}", p, "comfyui", cast))
        return save({k: v for k, v in sd.items() if v is not None}, dst, metadata=meta)
    if fmt in ("diffusers", "peft"):
        other = [m for m, p in lora.weights.items() if not isinstance(p, LowRank)] + list(lora.biases)
        if other:
            raise InputError(f"the {fmt} layout holds LoRA/DoRA only; {len(other)} module(s) carry other patches "
                             f"(LyCORIS or differences), e.g. {other[0]}", "use --to comfyui or --to kohya")
        sd, cfg = to_peft(lora.weights, "transformer." if fmt == "diffusers" else "base_model.model.")
        if base is not None:  # ComfyUI reads DoRA from `dora_scale` (diffusers drops that key on loading), on the
            swapped = swapped_modules(arch, n_blocks(lora.weights))  # rows of the original weight
            for m, p in lora.weights.items():
                if p.magnitude is not None and m in base:
                    q = LowRank(p.A, p.B, p.alpha, p.magnitude, magnitude_to_dora_scale(p, base[m]))
                    sd[f"{'transformer.' if fmt == 'diffusers' else 'base_model.model.'}{m}.dora_scale"] = \
                        dora_scale_order(q, m, swapped).dora_scale
        sd = {k: cast(v) for k, v in sd.items()}
        if fmt == "diffusers":
            meta["lora_adapter_metadata"] = json.dumps({f"transformer.{k}": v for k, v in cfg.items()},
                                                       sort_keys=True)
            return save(sd, dst, metadata=meta)
        dst.mkdir(parents=True, exist_ok=True)
        save(sd, dst / "adapter_model.safetensors", metadata=meta)

        with atomic_path(dst / "adapter_config.json") as tmp:
            Path(tmp).write_text(json.dumps({"peft_type": "LORA", **cfg}, indent=2, sort_keys=True))
        return dst
    if arch is None:
        raise InputError("cannot tell which model this LoRA is for (attention-only keys are shared by several)",
                         f"pass --family (one of: {', '.join(arch_names())})")
    weights = {}
    for m, p in lora.weights.items():
        if isinstance(p, LowRank) and p.magnitude is not None and p.dora_scale is None:
            if base is None or m not in base:
                raise InputError("DoRA in the ComfyUI/kohya convention depends on the base weights",
                                 "pass the model: convert lora ... --model DIR")
            p = LowRank(p.A, p.B, p.alpha, None, magnitude_to_dora_scale(p, base[m]))
        weights[m] = p
    widths = {m: w.shape[0] for m, w in base.items()} if base else None
    native = fuse_patches(weights, arch, widths, base)
    biases = fuse_biases(lora.biases, arch, widths)
    sd = {}
    fold = fmt == "comfyui" and not arch_adapter(arch).native_alpha_keys
    for name in sorted(set(native) | set(biases)):
        k = ("lora_unet_" + flat(name)) if fmt == "kohya" else ("diffusion_model." + name)
        if name in native:
            p = native[name]
            if fold and isinstance(p, LowRank) and p.dora_scale is None:
                p = p.folded()  # alpha in B: the key-less form (alpha == rank) every reader agrees on
                sd.update({f"{k}.lora_A.weight": cast(p.A), f"{k}.lora_B.weight": cast(p.B)})
                continue
            sd.update(_native_keys(k, p, fmt, cast))
        if name in biases:
            sd[f"{k}.diff_b"] = cast(biases[name])
    return save(sd, dst, metadata=meta)


def _native_keys(k: str, p, fmt: str, cast) -> dict:
    import torch

    if isinstance(p, Rows):
        p = Full(p.delta().float())  # a view that does not fuse back: its exact difference
    alpha = None if getattr(p, "alpha", None) is None else torch.tensor(float(p.alpha), dtype=torch.float32)
    if isinstance(p, LowRank):
        down, up = (".lora_down.weight", ".lora_up.weight") if fmt == "kohya" else (".lora_A.weight", ".lora_B.weight")
        out = {f"{k}{down}": cast(p.A), f"{k}{up}": cast(p.B), f"{k}.alpha": alpha}
        if p.dora_scale is not None:
            out[f"{k}.dora_scale"] = cast(p.dora_scale)
        return out
    if isinstance(p, LoKr):
        out = {f"{k}.{n}": cast(getattr(p, n)) for n in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b")
               if getattr(p, n) is not None}
        out = {kk.replace(f"{k}.", f"{k}.lokr_"): v for kk, v in out.items()}
    elif isinstance(p, LoHa):
        out = {f"{k}.hada_w1_a": cast(p.w1a), f"{k}.hada_w1_b": cast(p.w1b), f"{k}.hada_w2_a": cast(p.w2a),
               f"{k}.hada_w2_b": cast(p.w2b)}
    else:
        return {f"{k}.diff": cast(p.diff)}
    if alpha is not None:
        out[f"{k}.alpha"] = alpha
    return out


def to_peft(weights: dict, prefix: str = "transformer.") -> tuple[dict, dict]:
    """(state dict, peft LoraConfig dict) with alpha folded into B: every module's alpha equals its rank, so the
    file means the same to readers that take alpha from the config and to those that ignore it. DoRA modules
    carry peft's `lora_magnitude_vector`."""
    from collections import Counter

    sd, ranks, dora = {}, {}, set()
    for m, p in weights.items():
        if not isinstance(p, LowRank):
            raise InputError(f"{m}: a {kind_name(p)} patch has no peft LoRA form")
        q = p.folded()
        sd[f"{prefix}{m}.lora_A.weight"] = q.A
        sd[f"{prefix}{m}.lora_B.weight"] = q.B
        if p.dora:
            if p.magnitude is None and p.dora_scale is not None and p.dora_scale.shape[0] != p.B.shape[0]:
                raise InputError(f"{m}: its DoRA scale lies on the input axis (dora_scale {tuple(p.dora_scale.shape)}"
                                 ", LyCORIS' wd_on_out=False); peft and diffusers scale output rows only, so no "
                                 "diffusers or peft file holds it", "use --to comfyui or --to kohya (kept exactly)")
            if p.magnitude is None:
                raise InputError(f"{m}: DoRA stored as ComfyUI's dora_scale needs the base weights",
                                 "pass the model (--model DIR)")
            sd[f"{prefix}{m}.lora_magnitude_vector"] = p.magnitude
            dora.add(m)
        ranks[m] = q.rank
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 1
    rank_pattern = {m: rr for m, rr in ranks.items() if rr != r}
    if dora and len(dora) != len(weights):
        raise InputError("a LoRA with DoRA on some modules only has no single peft config",
                         "use --to comfyui or --to kohya")
    return sd, {"r": r, "lora_alpha": r, "rank_pattern": rank_pattern, "alpha_pattern": dict(rank_pattern),
                "target_modules": sorted(weights), "lora_dropout": 0.0, "bias": "none", "use_dora": bool(dora),
                "init_lora_weights": True, "use_rslora": False}
