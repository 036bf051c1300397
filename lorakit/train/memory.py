"""Will the run fit? An estimate of peak GPU memory, checked before any weights load.

peak ~= base weights (at the profile's storage) on the GPU (minus swapped blocks)
      + LoRA weights, gradients and optimizer states
      + activations: with gradient checkpointing each block keeps its input (tokens x hidden x 2 bytes)
        plus one block's working set; without, every block keeps its working set
      + a fixed allowance for the CUDA context, cuBLAS/cuDNN workspaces and fragmentation.
The working-set factor (16 bf16 values per token and hidden unit per block) is calibrated on the
measured FLUX.1-dev step of ../shared/BASELINES.md (1024², no checkpointing: 46.8 GiB peak).
"""

from __future__ import annotations

import json
from pathlib import Path

from lorakit.errors import InputError

GIB = 2**30
WORKING_SET = 16  # bf16 values per token x hidden unit kept by one block in backward (calibrated)
OVERHEAD_GIB = 2.0
BYTES_PER_PARAM = {"none": None, "fp8": 1.0, "qfloat8": 1.0, "nf4": 0.55}
# published architectures: hidden size, blocks, parameters (used when the folder does not say)
KNOWN = {"flux": (3072, 57, 11.9e9), "qwen_image": (3072, 60, 20.4e9), "kandinsky5": (1792, 32, 2.0e9)}


def _transformer_facts(cfg) -> tuple[int, int, float, str]:
    """(hidden, blocks, parameters, source) from the model folder, else the published sizes."""
    from lorakit.models.registry import family_info

    hidden, blocks, params = KNOWN[family_info(cfg.model.family).module]
    source = "published size"
    folder = Path(cfg.model.path) / "transformer" if cfg.model.path else None
    if folder is not None and (folder / "config.json").is_file():
        c = json.loads((folder / "config.json").read_text())
        heads, hd = c.get("num_attention_heads"), c.get("attention_head_dim")
        hidden = heads * hd if heads and hd else c.get("model_dim", hidden)
        blocks = (c.get("num_layers", 0) + c.get("num_single_layers", 0)) or c.get("num_visual_blocks", blocks)
        idx = sorted(folder.glob("*.safetensors.index.json"))
        if idx:
            total = json.loads(idx[0].read_text()).get("metadata", {}).get("total_size")
            if total:
                params, source = total / 2, f"{idx[0].name} (total_size)"  # stored in bf16
        else:
            files = list(folder.glob("*.safetensors"))
            if files:
                params, source = sum(f.stat().st_size for f in files) / 2, "weight files"
    return int(hidden), int(blocks), float(params), source


def estimate(cfg, world: int = 1) -> dict:
    """Peak GPU memory in GiB, by part (per GPU; `world` GPUs share a full fine-tune's states under FSDP)."""
    hidden, blocks, params, source = _transformer_facts(cfg)
    bpp = BYTES_PER_PARAM[cfg.memory.base_quant] or {"bf16": 2, "fp16": 2, "fp32": 4}[cfg.model.dtype]
    swapped = min(cfg.memory.blocks_to_swap, blocks)
    base = params * bpp * (1 - swapped / blocks)
    adam = 2 if (cfg.memory.optimizer_8bit or cfg.optim.name == "adamw8bit") else 8
    lora = params * 0.004 * cfg.lora.rank / 16 * (4 + 4 + adam)  # ~0.4% of the base at r16: fp32 weight, grad, Adam
    if cfg.method == "full":  # every weight trains: weight + grad + moments (bf16 AdamWBf16: 8 bytes in all)
        moments = 2 if adam == 2 else (4 if cfg.model.dtype == "bf16" else 8)  # 8-bit | bf16 | fp32 m and v
        per = bpp + bpp + moments
        base, lora = params * per / world, 0.0
        if world > 1:
            base += 2 * params * bpp / blocks  # FSDP gathers a block (and prefetches the next) in full
    tokens = (cfg.data.resolution // 16) ** 2
    if cfg.model.family.startswith("qwen-image-edit"):
        tokens *= 1 + (2 if cfg.model.family.endswith("plus") else 1)
    tokens = (tokens + 512) * cfg.schedule.batch_size
    per_block = tokens * hidden * 2 * WORKING_SET
    acts = (tokens * hidden * 2 * blocks + per_block) if cfg.memory.gradient_checkpointing else per_block * blocks
    parts = {"base": base / GIB, "lora_and_optimizer": lora / GIB, "activations": acts / GIB, "overhead": OVERHEAD_GIB}
    return {"gib": round(sum(parts.values()), 1), "parts": {k: round(v, 2) for k, v in parts.items()},
            "tokens": tokens, "blocks": blocks, "source": source}


def plan(cfg, budget_gib: float, world: int = 1):
    """The config with gradient checkpointing turned on when the run would not fit without it (profiles leave
    it off where memory allows: recomputing costs about a third more compute). Returns (cfg, note or None)."""
    if cfg.memory.gradient_checkpointing:
        return cfg, None
    est = estimate(cfg, world)["gib"]
    if est <= budget_gib:
        return cfg, None
    on = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"gradient_checkpointing": True})})
    return on, (f"gradient checkpointing on: without it this run needs about {est} GiB and the GPU has "
                f"{budget_gib:.0f}")


def check(cfg, budget_gib: float, world: int = 1) -> dict:
    """Refuse, with the estimate and what would fit, when the run will not fit in `budget_gib`."""
    est = estimate(cfg, world)
    if est["gib"] <= budget_gib:
        return est
    tips = []
    if not cfg.memory.gradient_checkpointing:
        tips.append("--set memory.gradient_checkpointing=true")
    for res in (cfg.data.resolution * 3 // 4 // 16 * 16, cfg.data.resolution // 2 // 16 * 16):
        if res >= 256 and estimate(cfg.model_copy(update={"data": cfg.data.model_copy(update={"resolution": res})}), world)[
                "gib"] <= budget_gib:
            tips.append(f"--set data.resolution={res}")
            break
    if cfg.method == "full":
        tips.append("more GPUs (--gpus N: FSDP shards weights, gradients and optimizer states)")
    elif cfg.memory.base_quant == "none":
        tips.append("--set memory.base_quant=fp8")
    swap = next((n for n in range(1, est["blocks"] + 1) if estimate(cfg.model_copy(update={
        "memory": cfg.memory.model_copy(update={"blocks_to_swap": n})}), world)["gib"] <= budget_gib), None)
    if swap and cfg.method == "lora" and not cfg.memory.blocks_to_swap:
        tips.append(f"--set memory.blocks_to_swap={swap} (slower: those blocks' weights cross PCIe twice a step)")
    if not tips:
        tips.append("a GPU with more memory")
    p = est["parts"]
    raise InputError(
        f"this run needs about {est['gib']} GiB of GPU memory and the {cfg.profile} profile has {budget_gib:.0f} "
        f"(base{' + gradients + optimizer' if cfg.method == 'full' else ''} {p['base']}, LoRA+optimizer {p['lora_and_optimizer']}, activations {p['activations']} at "
        f"{est['tokens']} tokens, overhead {p['overhead']}; from {est['source']})",
        "try " + " or ".join(tips) if not tips[-1].startswith("a GPU") else tips[-1])
