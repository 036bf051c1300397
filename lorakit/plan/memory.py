"""Will the run fit? An estimate of peak GPU memory, checked before any weights load.

peak ~= base weights (at the profile's storage) on the GPU (minus swapped blocks)
      + LoRA weights, gradients and optimizer states
      + activations: with gradient checkpointing each block keeps its input (tokens x hidden x 2 bytes)
        plus one block's working set; without, every block keeps its working set
      + a fixed allowance for the CUDA context, cuBLAS/cuDNN workspaces and fragmentation.
The working-set factor (bf16 values per token and hidden unit per block: 16 by default, the family's own where
measured otherwise) is calibrated on the measured FLUX.1-dev step on an H100 (1024², no checkpointing: 46.8 GiB
peak; docs/benchmarks-history.md); Kandinsky 5's blocks keep more (26: the H100's 40.8 GiB uncompiled at 1024²).
Uncompiled blocks (memory.compile off, swapping, FSDP) keep more than compiled ones: the family's
`Published.uncompiled` (1.25x by default; the Qwen-Image Edit models 25).
The model's size comes from its folder (config.json, the shard index's total_size), else from the family
adapter's published figures; its tokens (controls, video frames) from the adapter too.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from lorakit.data.plan import control_dirs_for
from lorakit.errors import InputError
from lorakit.hardware.gpu import env_cap_gib
from lorakit.hardware.profiles import load_profile
from lorakit.io.header import DTYPES, FLOATS, read_header
from lorakit.io.reader import resolve_files
from lorakit.models.base import family_adapter, trained_dir
from lorakit.models.native import block_of

GIB = 2**30
OVERHEAD_GIB = 2.0
BYTES_PER_PARAM = {"none": None, "fp8": 1.0, "qfloat8": 1.0, "nf4": 0.55}


def weight_split(tensors, quant: str, dtype_bytes: int) -> tuple[float, list[float]]:
    """(bytes outside the repeated blocks, each block's bytes) as training stores them: floats at the run's dtype;
    over an 8-bit or 4-bit base the blocks' Linear weights at that storage (8-bit: plus a float32 scale per row,
    as `train.quant` makes them), the rest unquantized. `tensors`: (name, safetensors dtype, shape) triples."""
    per = BYTES_PER_PARAM[quant]
    rest, blocks = 0.0, {}
    for name, dtype, shape in tensors:
        n = math.prod(shape)
        block = block_of(name)
        if dtype not in FLOATS:  # integers, float8: loaded as stored
            size = n * DTYPES[dtype][1]
        elif per and block and name.endswith(".weight") and len(shape) == 2:
            size = n * per + (4 * shape[0] if per == 1.0 else 0)
        else:
            size = n * dtype_bytes
        if block:
            blocks[block] = blocks.get(block, 0.0) + size
        else:
            rest += size
    return rest, list(blocks.values())


@functools.lru_cache(maxsize=8)
def folder_split(folder: str, quant: str, dtype_bytes: int) -> tuple[float, tuple[float, ...]] | None:
    """`weight_split` of a transformer folder's weights, from its safetensors headers (None where it has none).
    Cached: the plan estimates the same run once per candidate setting."""
    if not any(Path(folder).glob("*.safetensors")):
        return None
    tensors = [(k, v.dtype, v.shape) for f in resolve_files(Path(folder)) for k, v in read_header(f).tensors.items()]
    rest, blocks = weight_split(tensors, quant, dtype_bytes)
    return rest, tuple(blocks)


def _transformer_facts(cfg) -> tuple[int, int, float, str]:
    """(hidden, blocks, parameters, source) from the model folder, else the family's published sizes (the
    weights' sizes block by block: `folder_split`)."""
    adapter = family_adapter(cfg.model.family)
    pub = adapter.published
    hidden, blocks, params = pub.hidden, pub.blocks, pub.params
    source = f"published size: {pub.source}"
    folder = trained_dir(cfg)
    if folder is not None and (folder / "config.json").is_file():
        try:
            c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            c = None
        if not isinstance(c, dict):
            raise InputError(f"{folder / 'config.json'}: not a readable JSON object",
                             "re-download the model folder")
        try:
            hidden, blocks = adapter.transformer_size(c)
        except (KeyError, TypeError) as e:
            raise InputError(f"{folder / 'config.json'}: not a {adapter.info.transformer_class} config (no {e})",
                             "is model.family right for model.path?") from None
        idx = sorted(folder.glob("*.safetensors.index.json"))
        if idx:
            try:
                total = json.loads(idx[0].read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                raise InputError(f"{idx[0]}: not a readable shard index", "re-download the model folder") from None
            if isinstance(total, (int, float)) and total > 0:
                params, source = total / 2, f"{idx[0].name} (total_size)"  # stored in bf16
        else:
            files = list(folder.glob("*.safetensors"))
            if files:
                params, source = sum(f.stat().st_size for f in files) / 2, "weight files"
    return int(hidden), int(blocks), float(params), source


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # model.dtype


def eight_bit_moments(cfg) -> bool:
    """Does the optimizer keep its moments in 8 bits (bitsandbytes' AdamW)?"""
    return cfg.memory.optimizer_8bit or cfg.optim.name == "adamw8bit"


def needs_bitsandbytes(cfg) -> bool:
    """Does the run use bitsandbytes (8-bit AdamW states, an nf4 base)? Other runs leave it out of their process
    (`lorakit.unused`)."""
    return eight_bit_moments(cfg) or cfg.memory.base_quant == "nf4"


def moment_bytes(cfg) -> int:
    """Bytes per parameter of a full fine-tune's optimizer moments: 8-bit, bf16 (lorakit's bf16 AdamW) or fp32."""
    if eight_bit_moments(cfg):
        return 2
    return 4 if cfg.model.dtype == "bf16" else 8


def transformer_params(cfg) -> float:
    """The trained transformer's parameter count (its folder's sizes where it has them, else the published one)."""
    return _transformer_facts(cfg)[2]


def estimate(cfg, world: int = 1) -> dict:
    """Peak GPU memory in GiB, by part (per GPU; `world` GPUs share a full fine-tune's states under FSDP)."""
    hidden, blocks, params, source = _transformer_facts(cfg)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    bpp = BYTES_PER_PARAM[cfg.memory.base_quant] or dtype_bytes
    swapped = min(cfg.memory.blocks_to_swap, blocks)
    base = params * bpp * (1 - swapped / blocks)
    folder = trained_dir(cfg)
    split = folder_split(str(folder), cfg.memory.base_quant, dtype_bytes) if folder and folder.is_dir() else None
    if split and split[1]:  # the folder's own sizes: what stays unquantized, and blocks of unequal size
        rest, sizes = split[0], sorted(split[1])  # (FLUX.2's double blocks hold twice a single block's weights)
        away = sizes[:swapped]  # counted as the smallest that could go (the swapper sends the last: the small ones)
        base = rest + sum(sizes) - sum(away) + 2 * (away[-1] if away else 0)  # two visit at a time: one computes,
        # the next is copied
    adam = 2 if eight_bit_moments(cfg) else 8
    lora = params * 0.004 * cfg.lora.rank / 16 * (4 + 4 + adam)  # ~0.4% of the base at r16: fp32 weight, grad, Adam
    if cfg.method == "full":  # every weight trains: weight + grad + moments (bf16 AdamWBf16: 8 bytes in all)
        per = bpp + bpp + moment_bytes(cfg)
        base, lora = params * per / world, 0.0
        if world > 1:  # FSDP gathers a block (and prefetches the next) in full; kept blocks stay gathered
            base += (2 + gathered(cfg, blocks)) * params * bpp / blocks
    adapter = family_adapter(cfg.model.family)
    frames = max(cfg.data.frame_counts)  # the longest window (frame buckets)
    per_item = adapter.image_tokens(cfg.data.resolution, frames, controls_in_use(cfg, adapter),
                                    cfg.data.control_resolution)
    tokens = (per_item + adapter.published.text_tokens) * cfg.schedule.batch_size
    ckpt = checkpointed(cfg, blocks)  # a recomputed block keeps its input, the others their working set

    def activations(values: float) -> tuple[float, float]:
        per_block = tokens * hidden * 2 * values
        return ckpt * tokens * hidden * 2 + (blocks - ckpt) * per_block + (per_block if ckpt else 0), per_block

    eager = uncompiled(cfg)
    acts, per_block = activations(adapter.published.uncompiled if eager else adapter.published.working_set)
    parts = {"base": base / GIB, "lora_and_optimizer": lora / GIB, "activations": acts / GIB, "overhead": OVERHEAD_GIB}
    gib = sum(parts.values())
    return {"gib": round(gib, 1), "parts": {k: round(v, 2) for k, v in parts.items()},
            "tokens": tokens, "blocks": blocks, "block_gib": round(per_block / GIB, 2), "source": source,
            "uncompiled": eager,  # and what the same run needs while its blocks run uncompiled (a background compile)
            "uncompiled_gib": round(gib if eager else gib + (activations(adapter.published.uncompiled)[0] - acts)
                                    / GIB, 1)}


def uncompiled(cfg) -> bool:
    """Do the run's blocks run uncompiled (eager PyTorch keeps more for backward than compiled blocks)? Where
    memory.compile is off (the dgx-spark and cpu profiles) and with block swapping (which does not compile:
    `plan.decide.compile_decision`)."""
    m = cfg.memory
    return not m.compile or bool(m.blocks_to_swap)


# what memory.gathered_blocks auto leaves free of the card: FSDP's reserved memory ran 3-5 GiB above the estimate
# (five runs, 2x H200, 2026-11-27), and a step near the card's edge took twice as long (`plan_gathered`)
GATHER_HEADROOM = 0.15


def gathered(cfg, blocks: int) -> int:
    """How many blocks keep their gathered weights from forward to backward under FSDP (auto: none, until
    planned)."""
    n = cfg.memory.gathered_blocks
    return 0 if n == "auto" else min(n, blocks)


def plan_gathered(cfg, budget_gib: float, world: int):
    """A full fine-tune under FSDP with memory.gathered_blocks auto: the most blocks that can stay gathered with
    the estimate within `budget_gib` less GATHER_HEADROOM of it. Measured on 2x H200 (2026-11-27, 1024², compiled
    blocks, s/step and GiB allocated / reserved per GPU): FLUX.1-dev none kept 0.729 (61.9 / 74.2), all 57 kept
    0.652-0.692 (83.6 / 96.4); Qwen-Image none 0.947 (89.4 / 109.6), 20 kept 0.903 (100.9 / 120.9), 53 kept (the
    estimate at 138.1 of 140) 1.810 (121.8 / 137.7: the allocator at the card's edge). Returns (cfg, note)."""
    def keeping(n):
        return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"gathered_blocks": n})})

    if cfg.method != "full" or world <= 1 or cfg.memory.gathered_blocks != "auto":
        return cfg, None
    blocks = estimate(cfg, world)["blocks"]
    room = budget_gib * (1 - GATHER_HEADROOM)
    for n in range(blocks, 0, -1):  # the most that fit
        gib = estimate(keeping(n), world)["gib"]
        if gib <= room:
            return keeping(n), (f"FSDP: the last {n} of {blocks} blocks keep their gathered weights from forward "
                                f"to backward (about {gib} GiB of {budget_gib:.0f})")
    return keeping(0), None


def controls_in_use(cfg, adapter) -> int:
    """Control images per item the run will encode: the control folders of its datasets where they exist
    (the family's maximum otherwise: the estimate must not be low)."""
    if not adapter.max_controls:
        return 0
    counts = [len(control_dirs_for(cfg, Path(d))) for d in (x.dir for x in cfg.data.all_datasets()) if Path(d).is_dir()]
    return min(max(counts), adapter.max_controls) if counts else adapter.max_controls


def checkpointed(cfg, blocks: int) -> int:
    """How many of the transformer's blocks recompute in backward under this config."""
    m = cfg.memory
    if not m.gradient_checkpointing:
        return 0
    return blocks if isinstance(m.checkpoint_blocks, str) else min(m.checkpoint_blocks, blocks)  # auto: all, until planned


# what partial checkpointing leaves unplanned: the estimate's error (measured within 1.5 GiB; on the H100 the
# planned runs peaked 0.2-8.5 GiB below their estimates: docs/benchmarks-history.md)
PLAN_MARGIN_GIB = 1.5


def plan(cfg, budget_gib: float, world: int = 1):
    """Gradient checkpointing where the run needs it. Profiles leave it off where memory allows (recomputing a
    block costs about a third of its compute again); it is turned on when the run would not fit without it.
    With `memory.checkpoint_blocks: auto` only the blocks that must recompute do: the fewest with which the
    estimate fits `budget_gib` less a margin (none: checkpointing off). Block swapping and FSDP keep whole-model
    checkpointing. Returns (cfg, note or None)."""
    m = cfg.memory

    def with_ckpt(n):
        return cfg.model_copy(update={"memory": m.model_copy(update={"gradient_checkpointing": n != 0,
                                                                     "checkpoint_blocks": n})})

    est = estimate(cfg, world)
    turned_on = (cfg.model_copy(update={"memory": m.model_copy(update={"gradient_checkpointing": True})}),
                 f"gradient checkpointing on: without it this run needs about {est['gib']} GiB and the GPU has "
                 f"{budget_gib:.0f}")
    if m.checkpoint_blocks != "auto" or m.blocks_to_swap or world > 1:
        return (cfg, None) if m.gradient_checkpointing or est["gib"] <= budget_gib else turned_on
    if not m.gradient_checkpointing and est["gib"] <= budget_gib:
        return with_ckpt(0), None
    blocks = est["blocks"]
    n = next((n for n in range(blocks + 1) if estimate(with_ckpt(n), world)["gib"] <= budget_gib - PLAN_MARGIN_GIB),
             blocks)  # nothing fits with the margin: all blocks (the check then decides)
    if n == blocks:
        return (with_ckpt(blocks), None) if m.gradient_checkpointing else (with_ckpt(blocks), turned_on[1])
    if n == 0:
        return with_ckpt(0), ("gradient checkpointing off: every block's activations fit in "
                              f"{budget_gib:.0f} GiB (about {estimate(with_ckpt(0), world)['gib']} GiB)")
    return with_ckpt(n), (f"gradient checkpointing on {n} of {blocks} blocks: about "
                          f"{estimate(with_ckpt(n), world)['gib']} GiB of {budget_gib:.0f} "
                          f"(all {blocks}: {estimate(with_ckpt(blocks), world)['gib']} GiB, none: "
                          f"{estimate(with_ckpt(0), world)['gib']} GiB)")


def check(cfg, budget_gib: float, world: int = 1) -> dict:
    """Refuse, with the estimate and what would fit, when the run will not fit in `budget_gib`."""
    est = estimate(cfg, world)
    if est["gib"] <= budget_gib:
        return est
    tips = []
    fits = budget_gib - PLAN_MARGIN_GIB  # a suggested setting keeps the plan's margin (with none, a run the
    # estimate put at the cap ran out of memory: Qwen-Image-Edit under 24 GiB, 5 blocks swapped, H100)
    if not cfg.memory.gradient_checkpointing:
        tips.append("--set memory.gradient_checkpointing=true")
    for res in (cfg.data.resolution * 3 // 4 // 16 * 16, cfg.data.resolution // 2 // 16 * 16):
        if res >= 256 and estimate(cfg.model_copy(update={"data": cfg.data.model_copy(update={"resolution": res})}), world)[
                "gib"] <= fits:
            tips.append(f"--set data.resolution={res}")
            break
    if cfg.method == "full":
        tips.append("more GPUs (--gpus N: FSDP shards weights, gradients and optimizer states)")
    elif cfg.memory.base_quant == "none":
        tips.append("--set memory.base_quant=fp8")
    can_swap = cfg.method == "lora" and not cfg.memory.blocks_to_swap
    swap = _swap_for(cfg, est["blocks"], fits, world) if can_swap else None
    if swap:
        tips.append(f"--set memory.blocks_to_swap={swap} (slower: those blocks' weights cross PCIe twice a step)")
    tips += _smaller_controls(cfg, fits, world, swap)
    if not tips:
        tips.append("a GPU with more memory")
    p = est["parts"]
    raise InputError(
        f"this run needs about {est['gib']} GiB of GPU memory and the {cfg.profile} profile has {budget_gib:.0f} "
        f"(base{' + gradients + optimizer' if cfg.method == 'full' else ''} {p['base']}, LoRA+optimizer {p['lora_and_optimizer']}, activations {p['activations']} at "
        f"{est['tokens']} tokens, overhead {p['overhead']}; from {est['source']})",
        "try " + " or ".join(tips) if not tips[-1].startswith("a GPU") else tips[-1])


def _swap_for(cfg, blocks: int, fits: float, world: int) -> int | None:
    """The fewest swapped blocks that bring the estimate within `fits` GiB (None: no count does)."""
    return next((n for n in range(1, blocks + 1) if estimate(cfg.model_copy(update={
        "memory": cfg.memory.model_copy(update={"blocks_to_swap": n})}), world)["gib"] <= fits), None)


def _smaller_controls(cfg, fits: float, world: int, swap: int | None) -> list[str]:
    """An edit family's other way to fit: its control images at half the resolution (fewer tokens), alone where
    that fits, else with the fewer swapped blocks it then needs than `swap` (FLUX.2 [dev] Edit under 24 GiB: 52 of
    56 blocks swapped at the defaults: the refusal seen on 2026-11-26)."""
    half = cfg.data.resolution // 2 // 16 * 16
    if half < 256 or not controls_in_use(cfg, family_adapter(cfg.model.family)) or (
            cfg.data.control_resolution and cfg.data.control_resolution <= half):
        return []
    small = cfg.model_copy(update={"data": cfg.data.model_copy(update={"control_resolution": half})})
    est = estimate(small, world)
    if est["gib"] <= fits:
        return [f"--set data.control_resolution={half} (the control images at {half}² pixels)"]
    fewer = _swap_for(small, est["blocks"], fits, world) if swap else None
    return [f"--set data.control_resolution={half} --set memory.blocks_to_swap={fewer} (the control images at "
            f"{half}² pixels, fewer blocks swapped)"] if fewer and fewer < swap else []


def fit_to_gpu(cfg, cap_gib: float | None = None, world: int = 1):
    """Fit the run to the GPU (detected, else the profile's card; `cap_gib` if given): gradient checkpointing
    turned on where it is needed, then the estimate checked (refused with suggestions when it cannot fit).

    Returns:
        (cfg, estimate or None for the cpu profile, note or None).
    """
    import torch

    hw = load_profile(cfg.profile).hardware
    if not hw.get("gpu"):
        return cfg, None, None
    cap_gib = cap_gib or env_cap_gib()
    if cap_gib:
        budget = cap_gib
    elif torch.cuda.is_available():
        budget = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        budget = float(hw.get("memory_gib") or hw.get("min_memory_gib") or 0)
    cfg, note = plan(cfg, budget, world)
    cfg, kept = plan_gathered(cfg, budget, world)
    note = "; ".join(n for n in (note, kept) if n) or None
    return cfg, {**check(cfg, budget, world), "budget_gib": round(budget, 1)}, note
