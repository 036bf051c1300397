"""LoRA on the transformer (peft): target modules from the family's presets, and the diffusers-format LoRA file."""

from __future__ import annotations

from pathlib import Path

from lorakit.convert import lora as L
from lorakit.convert import verify as V
from lorakit.errors import ConfigError, FileFormatError
from lorakit.io import load
from lorakit.models.base import family_adapter
from lorakit.models.native import in_block
from lorakit.models.registry import family_info


def target_modules(transformer, adapter, targets, io: bool = False) -> list[str]:
    """Module names for a preset (attention | attention_mlp | all_linear: inside the blocks) or an explicit
    list (matched anywhere), checked against the model so a typo is an error, not a LoRA that trains nothing;
    `io` adds the family's latent in/out layers. The presets are the family adapter's (`lora_presets`).

    Raises:
        ConfigError: a listed name matches nothing, or a preset matches no module of this transformer.
    """
    import torch

    names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = [n for n in names if in_block(n)]
    io_names = adapter.lora_presets.io
    extra = [n for n in names if n in io_names] if io else []
    if io and len(extra) != len(io_names):
        absent = [n for n in io_names if n not in extra]
        raise ConfigError([f"lora.train_io: the {adapter.family} transformer has no Linear {', '.join(absent)}"])
    if targets == "all_linear":
        return in_blocks + extra
    explicit = not isinstance(targets, str)
    wanted = list(targets) if explicit else list(adapter.preset_modules(targets))
    pool = names if explicit else in_blocks  # an explicit list may name any Linear (e.g. proj_out)
    found = [n for n in pool if any(n == w or n.endswith("." + w) for w in wanted)]
    missing = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in pool)]
    if explicit and missing:
        raise ConfigError([f"lora.targets: no Linear module named {w!r} in the transformer" for w in missing],
                          hint=f"examples: {', '.join(sorted({n.split('.')[-1] for n in in_blocks})[:12])}")
    if missing:  # a preset entry this transformer lacks: the family's facts and the model disagree
        raise ConfigError([f"lora.targets: preset {targets!r} of {adapter.family} names {', '.join(missing)}, "
                           "which this transformer does not have"],
                          hint="is model.family right for model.path?")
    if not found:
        raise ConfigError([f"lora.targets: {targets!r} matches no module of this transformer"])
    return found + [n for n in extra if n not in found]


def add_lora(transformer, adapter, cfg, device: str | None = None) -> dict:
    """Attach a LoRA adapter; returns its peft config as a dict (for the file's metadata).

    `device`: where every base layer already is (the GPU unless blocks swap): the adapter's weights are made and
    initialised there. peft otherwise makes each on the CPU and copies it to its layer's device, two blocking copies
    a layer: with 840 Qwen-Image layers 2.4 s on an idle card, 22.8 s on one that the first run's attention
    self-test shares (one card of a 2x H200 host, 2026-11-30, `tools/peer_musubi.py compare --setting
    unconstrained`)."""
    import torch
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    c = cfg.lora
    modules = target_modules(transformer, adapter, c.targets, io=c.train_io)
    alpha = c.alpha or c.rank
    if c.type == "lokr":  # w2 (or its factors) starts at zero: the adapter begins as the identity
        lcfg = LoKrConfig(r=c.rank, alpha=alpha, rank_dropout=c.dropout, decompose_factor=c.factor,
                          target_modules=modules)
    elif c.type == "loha":
        lcfg = LoHaConfig(r=c.rank, alpha=alpha, rank_dropout=c.dropout, target_modules=modules)
    else:
        lcfg = LoraConfig(r=c.rank, lora_alpha=alpha, lora_dropout=c.dropout,
                          init_lora_weights="gaussian" if c.init == "gaussian" else True,
                          target_modules=modules, use_dora=c.is_dora)
    with torch.device(device or "cpu"):
        transformer.add_adapter(lcfg)
    return lcfg.to_dict()


def keep_input_dtype(transformer) -> int:
    """Turn off peft's cast of each LoRA layer's input to the LoRA weights' dtype. lorakit trains those weights in
    fp32 and runs the model under autocast, whose matmuls cast the input back to bf16: two copies of every activation
    a LoRA layer reads, per call, and two more in backward, for the same products (a bf16 -> fp32 -> bf16 round trip
    is exact). FLUX.1-dev 1024² uncompiled on one H200 (2026-11-29, `lorakit bench step --trace`): 5,712 copies in
    two steps against plain diffusers' 1,690 before, 5,560 after (0.552 and 0.561 s/step): most are autocast's own
    (fp32 LoRA weights cast per matmul, layer norms in fp32, their backward), which this leaves. Returns the layers
    changed."""
    n = 0
    for m in transformer.modules():
        if getattr(m, "cast_input_dtype_enabled", None) is True:
            m.cast_input_dtype_enabled = False
            n += 1
    return n


def lora_state_dict(transformer) -> dict:
    """The trainable LoRA tensors exactly as they are (peft names, "transformer." prefix): what resume restores."""
    from peft.utils import get_peft_model_state_dict

    return {f"transformer.{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def save_lora(transformer, path: Path, family: str, extra: dict | None = None, check: bool = True,
              clock=None) -> dict | None:
    """Write the LoRA the way every consumer reads alike (`convert.lora.write`, in the family's
    `lora_file_layout`: diffusers names, alpha folded into B, for most; DoRA with ComfyUI's dora_scale beside peft's magnitude), then read it back as diffusers and as
    ComfyUI would and compare with the trained modules (`convert.verify`). Returns that comparison. `clock`: a
    `train.prepare.Clock` told when the file is written and when it is checked.

    Raises:
        RuntimeError: a consumer would apply something else than what was trained (a bug: nothing is hidden).
    """
    t = V.trained(transformer)
    dora = any(getattr(p, "dora", False) for p in t.weights.values())  # LoKr/LoHa patches have no DoRA
    base = V.base_weights(transformer, t.weights) if dora else None
    meta = {k: str(v) for k, v in (extra or {}).items()}
    layout = family_adapter(family).file_layout(t.weights)  # Wan: the original names, which both readers read
    L.write(t, path, layout, family_info(family).arch, extra_metadata=meta, base=base)
    if clock:
        clock.lap("LoRA file")
    if not check:
        return None
    result = V.check_file(path, family, t, base, shapes=V.module_shapes(transformer))
    if clock:
        clock.lap("read back as diffusers and ComfyUI read it")
    bad = {k: v for k, v in result.items() if v != "equal" and not v.startswith(("not compared", V.PARTIAL))}
    if bad:
        raise RuntimeError(f"{path}: read back as a consumer would, it differs from what was trained: {bad}")
    return result


def load_lora_into(transformer, source) -> None:
    """Restore LoRA tensors (lora_state_dict's, or an older checkpoint's raw lora.safetensors) into an adapter of
    the same shape."""
    from peft.utils import set_peft_model_state_dict

    raw = source if isinstance(source, dict) else load(source, copy=True)
    sd = {k.removeprefix("transformer."): v for k, v in raw.items() if not k.endswith(".dora_scale")}
    result = set_peft_model_state_dict(transformer, sd)
    if getattr(result, "unexpected_keys", None):
        raise FileFormatError(f"{source if not isinstance(source, dict) else 'checkpoint'}: LoRA keys this model "
                              f"does not have: {result.unexpected_keys[:3]}")
