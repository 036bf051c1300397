"""LoRA on the transformer (peft), target presets per family, and the diffusers-format LoRA file."""

from __future__ import annotations

import json
from pathlib import Path

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
# the layers between the latent space and the blocks: the patch embedder, the final norm's modulation and the
# output projection (lora.train_io) — with them the LoRA can change how latents enter and leave the model
IO = {
    "flux": ["x_embedder", "norm_out.linear", "proj_out"],
    "qwen_image": ["img_in", "norm_out.linear", "proj_out"],
    "kandinsky5": ["visual_embeddings.in_layer", "out_layer.modulation.out_layer", "out_layer.out_layer"],
}
MLP = {
    "flux": ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
    "qwen_image": ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"],
    "kandinsky5": ["feed_forward.in_layer", "feed_forward.out_layer"],
}


def target_modules(transformer, family_module: str, targets, io: bool = False) -> list[str]:
    """Module names for a preset (attention | attention_mlp | all_linear: inside the blocks) or an explicit
    list (matched anywhere), checked against the model so a typo is an error, not a LoRA that trains nothing;
    `io` adds the family's latent in/out layers (IO)."""
    import torch

    from lorakit.errors import ConfigError

    names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = [n for n in names if "blocks." in n]
    extra = [n for n in names if n in IO.get(family_module, [])] if io else []
    if targets == "all_linear":
        return in_blocks + extra
    if not isinstance(targets, str):
        in_blocks = names  # an explicit list may name any Linear (e.g. proj_out)
    wanted = (ATTENTION if targets in ("attention", "attention_mlp") else list(targets))
    if targets == "attention_mlp":
        wanted = wanted + MLP.get(family_module, [])
    found = [n for n in in_blocks if any(n == w or n.endswith("." + w) for w in wanted)]
    missing = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in in_blocks)]
    if not isinstance(targets, str) and missing:
        raise ConfigError([f"lora.targets: no Linear module named {w!r} in the transformer" for w in missing],
                          hint=f"examples: {', '.join(sorted({n.split('.')[-1] for n in in_blocks})[:12])}")
    if not found:
        raise ConfigError([f"lora.targets: {targets!r} matches no module of this transformer"])
    return found + [n for n in extra if n not in found]


def add_lora(transformer, family_module: str, cfg) -> dict:
    """Attach a LoRA adapter; returns its peft config as a dict (for the file's metadata)."""
    from peft import LoraConfig

    modules = target_modules(transformer, family_module, cfg.lora.targets, io=cfg.lora.train_io)
    lcfg = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha or cfg.lora.rank, lora_dropout=cfg.lora.dropout,
                      init_lora_weights="gaussian" if cfg.lora.init == "gaussian" else True,
                      target_modules=modules, use_dora=cfg.lora.dora)
    transformer.add_adapter(lcfg)
    return lcfg.to_dict()


def lora_state_dict(transformer) -> dict:
    """The trained LoRA tensors with diffusers' key names ("transformer." + peft names)."""
    from peft.utils import get_peft_model_state_dict

    return {f"transformer.{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def save_lora(transformer, path: Path, peft_config: dict, extra: dict | None = None) -> Path:
    """Write the LoRA atomically in diffusers' format (pipe.load_lora_weights reads it)."""
    from lorakit.io import save

    # Dropout is for training only. diffusers' load_lora_weights creates the LoRA layers in training mode,
    # so a non-zero lora_dropout in the file would make every stock inference stochastic: write 0.
    cfg = {**peft_config, "lora_dropout": 0.0}
    meta = {f"transformer.{k}": (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True, default=str)}
    metadata.update({k: str(v) for k, v in (extra or {}).items()})
    return save({k: v.cpu() for k, v in lora_state_dict(transformer).items()}, path, metadata=metadata)


def load_lora_into(transformer, path: Path) -> None:
    """Restore LoRA weights written by save_lora into an adapter of the same shape."""
    from peft.utils import set_peft_model_state_dict

    from lorakit.io import load

    sd = {k.removeprefix("transformer."): v for k, v in load(path, copy=True).items()}
    result = set_peft_model_state_dict(transformer, sd)
    if getattr(result, "unexpected_keys", None):
        from lorakit.errors import FileFormatError

        raise FileFormatError(f"{path}: LoRA keys this model does not have: {result.unexpected_keys[:3]}")
