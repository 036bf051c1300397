"""Where a pipeline's weights live while it generates, chosen in this order:

- `none`: all on the GPU, when they fit;
- `model`: each component on the GPU only while it runs (`Swap`: its CPU copy kept, the GPU copy dropped after,
  never copied back), when each fits alone;
- `fp8`: as `model`, with the transformer's block weights stored in float8 e4m3 plus a scale per row (the
  rtx4090/rtx5090 profiles' training base, `train.quant.Float8Linear`), when that transformer fits; LoRAs are
  added into the weights before they are stored in 8 bits (as ComfyUI applies a LoRA to an fp8 model);
- `group`: every component's blocks streamed from CPU memory one at a time, the rest on the GPU (`io.stream`):
  bf16 on any card, but PCIe-bound.
In `model` and `fp8`, a text encoder too large to visit whole (FLUX.2 [dev]'s 45 GiB one on a 24/32 GiB card)
streams its blocks the same way while the rest is placed as the mode says.

The room to work in beside the weights is the larger of a generation's activations (`HEADROOM_GIB`) and the VAE's
decode at the requested output size (`decode_need`: a 768x512 Kandinsky 5 clip decodes in 21 GiB, a 2048² Qwen-Image
in 16.5). Where even the VAE alone cannot decode the whole output on the card, it decodes in tiles (`tile_vae`).

The choice comes from the weight sizes in the safetensors headers and the card's memory (or
LORAKIT_MEMORY_CAP_GIB), before anything is loaded; `--offload` forces one. Outputs are the same in every mode
but `fp8` (its weights are rounded to 8 bits: close to bf16's image, not equal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import InputError
from lorakit.io.stream import folder_gib, stream, too_large
from lorakit.plan.memory import folder_split

MODES = ("auto", "none", "model", "fp8", "group")
# everything resident: the activations of one 1024² generation plus the VAE decode (FLUX ~3, Qwen-Image ~4 GiB
# measured on the H100), the LoRA and the allocator's slack; also what a text encoder or VAE needs alone
HEADROOM_GIB = 5.0
# the transformer alone: one denoising forward at 1024² without gradients (< 1 GiB for FLUX and Qwen-Image)
# plus the allocator's slack
DENOISE_GIB = 3.0
# above a decode's measured peak: the allocator's slack and cuDNN's workspaces (the HunyuanVideo VAE held to its peak
# + 1 GiB fell back to other convolution algorithms: 2x slower and up to 0.016 off; + 2 GiB it decoded identically)
SLACK_GIB = 2.0
# A VAE's decode beside its weights (bf16, whole output, torch.cuda.max_memory_allocated; random weights at the
# published configs on an H100 80GB HBM3, 2026-11-26), GiB per million output pixels:
#   FLUX.1's AutoencoderKL: 2.38 / 5.35 / 9.50 GiB at 1024² / 1536² / 2048² (also Z-Image's and Kandinsky 5 T2I's);
#   Qwen-Image's: 4.13 / 9.29 / 16.51;
#   HunyuanVideo's (Kandinsky 5 T2V), which decodes 17 frames at a time: 14.17 at 512² x 17 frames, 14.33 at 512² x
#   121, 21.19 at 768x512 x 17, 31.77 at 1024x576 x 17; 4.55 at 512² x 5 frames, 1.23 at 512² x 1.
#   FLUX.2's AutoencoderKLFlux2: 2.41 / 9.51 at 1024² / 2048² (FLUX.1's decoder widths; its tiles taken as FLUX.1's).
DECODE_GIB_PER_MPX = {"AutoencoderKL": 2.27, "AutoencoderKLFlux2": 2.27, "AutoencoderKLQwenImage": 3.94}
VIDEO_VAE = "AutoencoderKLHunyuanVideo"
VIDEO_CHUNK = 17  # frames it decodes at once
# the same in tiles (diffusers' enable_tiling defaults), nearly whatever the size: FLUX.1's 2.38-2.40 GiB,
# Qwen-Image's 0.27-0.30, HunyuanVideo's 3.57-3.88 (plus the finished frames)
TILED_GIB = {"AutoencoderKL": 2.4, "AutoencoderKLFlux2": 2.4, "AutoencoderKLQwenImage": 0.3, VIDEO_VAE: 3.9}


@dataclass
class Decode:
    """What the VAE's decode of one output needs beside its weights: `whole_gib` at once, `tiled_gib` in tiles;
    `whole_ok` False where the whole decode cannot run at all."""
    size: str
    whole_gib: float
    tiled_gib: float
    whole_ok: bool = True


def decode_need(vae_class: str, width: int, height: int, frames: int = 1) -> Decode | None:
    """The decode of one `width` x `height` output (`frames` for a video VAE) by a VAE of that class (None: a class
    not measured, left to the fixed headroom)."""
    mpx = width * height / 1e6
    size = f"{width}x{height}" + (f" x {frames} frames" if vae_class == VIDEO_VAE else "")
    if vae_class == VIDEO_VAE:
        out_gib = 3 * max(frames, 1) * width * height * 4 / 2**30  # the finished frames, float32
        chunk = min(max(frames, 1), VIDEO_CHUNK)
        # ~4.7 GiB per million pixels for the first frame of a chunk, ~3.1 for each further one (the figures above)
        whole = mpx * (4.7 + 3.1 * (chunk - 1)) + out_gib
        # its last upsampling of a 17-frame chunk makes (frames - 1) x height x width x 128 values: at 2^31 the kernel
        # refuses (1024² x 17 frames: "CUDA error: invalid argument"; 1024x576 decoded)
        ok = (chunk - 1) * width * height * 128 < 2**31
        return Decode(size, round(whole, 2), round(TILED_GIB[VIDEO_VAE] + out_gib, 2), ok)
    if vae_class not in DECODE_GIB_PER_MPX:
        return None
    return Decode(size, round(mpx * DECODE_GIB_PER_MPX[vae_class], 2), TILED_GIB[vae_class])


@dataclass
class Plan:
    mode: str  # none | model | fp8 | group
    why: str
    sizes_gib: dict
    streamed: tuple = ()  # model / fp8: text encoders too large to visit whole, their blocks streamed instead
    tile_vae: bool = False  # the VAE decodes in tiles (`decode_need`): its whole decode does not fit or cannot run


def component_gib(model_dir: Path, names, dtype_bytes: int) -> dict[str, float]:
    """Each weight component's size in GiB at `dtype_bytes` per floating-point element (from its headers)."""
    sizes = {name: folder_gib(Path(model_dir) / name, dtype_bytes) for name in names}
    return {k: v for k, v in sizes.items() if v is not None}


def fp8_bytes(folder: Path, dtype_bytes: int) -> int:
    """A transformer's size with its block Linear weights in float8 plus a float32 scale per row (what
    `train.quant.quantize_blocks` makes), the rest at `dtype_bytes` (from its headers: `plan.memory.folder_split`,
    the training estimate's count)."""
    rest, blocks = folder_split(str(folder), "fp8", dtype_bytes) or (0, ())
    return int(rest + sum(blocks))


def fp8_gib(folder: Path, dtype_bytes: int) -> float:
    return round(fp8_bytes(folder, dtype_bytes) / 2**30, 2)


def _fits_alone(sizes: dict[str, float], budget_gib: float, fp8: dict[str, float] | None = None,
                decode_gib: float = HEADROOM_GIB) -> bool:
    """Each component on the GPU by itself: a transformer (Wan 2.2 A14B: either expert) with a denoising forward's
    room, at its fp8 size where `fp8` gives one; the VAE with its decode's; the others with the headroom (a text
    encoder's forward)."""
    for name, gib in sizes.items():
        need = (fp8 or {}).get(name, gib) + DENOISE_GIB if name.startswith("transformer") \
            else gib + (decode_gib if name == "vae" else HEADROOM_GIB)
        if need > budget_gib:
            return False
    return True


def _tiles(sizes: dict[str, float], budget_gib: float, decode: Decode | None) -> tuple[bool, str]:
    """Whether the VAE decodes in tiles, and why: where its whole decode cannot run, or does not fit the card beside
    the VAE's own weights (then nothing else is on the GPU in `model` placement)."""
    if decode is None:
        return False, ""
    if not decode.whole_ok:
        return True, f"; the VAE decodes in tiles (a whole {decode.size} decode exceeds its kernels' limits)"
    if sizes.get("vae", 0.0) + decode.whole_gib + SLACK_GIB > budget_gib:
        return True, (f"; the VAE decodes in tiles (a whole {decode.size} decode needs {decode.whole_gib:.1f} GiB): "
                      "close to the stock pipeline's output, not equal")
    return False, ""


def choose(sizes: dict[str, float], budget_gib: float, mode: str = "auto",
           headroom_gib: float = HEADROOM_GIB, fp8_sizes: dict[str, float] | None = None,
           decode: Decode | None = None) -> Plan:
    """`sizes`: each component's GiB at the run's dtype; `fp8_sizes`: each transformer's GiB with fp8 blocks
    (`fp8_gib`: `transformer`, and Wan 2.2 A14B's `transformer_2`), None where that is not offered; `decode`:
    the VAE's decode at the output size (`decode_need`), which widens the headroom where it is larger."""
    if mode not in MODES:
        raise InputError(f"--offload {mode}: not one of {', '.join(MODES)}")
    tile, tiled = _tiles(sizes, budget_gib, decode)
    decode_gib = max(HEADROOM_GIB, ((decode.tiled_gib if tile else decode.whole_gib) + SLACK_GIB) if decode else 0)
    headroom_gib = max(headroom_gib, decode_gib)
    if mode != "auto":
        return Plan(mode, f"--offload {mode}{tiled}", sizes, tile_vae=tile)
    plan = _choose(sizes, budget_gib, headroom_gib, fp8_sizes, decode_gib)
    plan.why += tiled
    plan.tile_vae = tile
    return plan


def _choose(sizes, budget_gib, headroom_gib, fp8, decode_gib) -> Plan:
    total, largest = sum(sizes.values()), max(sizes.values(), default=0.0)
    if total + headroom_gib <= budget_gib:
        return Plan("none", f"all weights ({total:.1f} GiB) + {headroom_gib:.1f} GiB to work in fit in "
                            f"{budget_gib:.1f} GiB", sizes)
    # a text encoder larger than the card (FLUX.2 [dev]'s 24 B Mistral on a 32 GiB one) runs once per image:
    # its blocks stream while the rest is placed as if it were not there
    streamed = tuple(n for n, gib in sizes.items() if n.startswith("text_encoder") and too_large(gib, budget_gib))
    rest = {n: gib for n, gib in sizes.items() if n not in streamed}
    also = f"; {', '.join(streamed)} streamed block by block" if streamed else ""
    if _fits_alone(rest, budget_gib, decode_gib=decode_gib):
        return Plan("model", f"weights {total:.1f} GiB + {headroom_gib:.1f} GiB to work in > {budget_gib:.1f} GiB: "
                             f"each component on the GPU while it runs (largest {largest:.1f} GiB){also}", sizes,
                    streamed)
    trs = {n: gib for n, gib in sizes.items() if n.startswith("transformer")}
    if fp8 and trs and set(trs) <= set(fp8) and _fits_alone(rest, budget_gib, fp8, decode_gib):
        were = " + ".join(f"{gib:.1f}" for gib in trs.values())
        now = " + ".join(f"{fp8[n]:.1f}" for n in trs)
        which = "the transformer" if len(trs) == 1 else f"each of the {len(trs)} transformers"
        return Plan("fp8", f"{which} ({were} GiB) does not fit {budget_gib:.1f} GiB: its block weights in fp8 "
                           f"({now} GiB, as the small-card profiles train), each component on the GPU while it "
                           f"runs; images close to bf16's, not equal (--offload group keeps bf16, slower){also}",
                    sizes, streamed)
    return Plan("group", f"the largest component ({largest:.1f} GiB) does not fit {budget_gib:.1f} GiB with "
                         f"room to work in: its blocks stream from CPU memory", sizes)


class Swap:
    """Pipeline components on the GPU one at a time, for inference (frozen weights). Each keeps its CPU tensors:
    bringing it copies them to the GPU, putting it away drops the GPU copies — nothing is copied back. (diffusers'
    `enable_model_cpu_offload` moves a component back with `Module.to("cpu")`, which allocates and fills new
    host memory: 10.8 s for FLUX's fp8 transformer and ~9 s for T5 on the H100 host, every image.)"""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.current = None
        self.host: dict[int, list] = {}  # id(module) -> [(tensor, its CPU data)]

    def add(self, module) -> None:
        from accelerate.hooks import add_hook_to_module

        tensors = list(module.parameters()) + list(module.buffers())
        self.host[id(module)] = [(t, t.data) for t in tensors]
        add_hook_to_module(module, _hook_class()(self))

    def bring(self, module) -> None:
        if self.current is module:
            return
        if self.current is not None:
            self.put_away(self.current)
        for t, host in self.host[id(module)]:
            t.data = host.to(self.device, non_blocking=True)
        self.current = module

    def put_away(self, module) -> None:
        for t, host in self.host[id(module)]:
            t.data = host
        self.current = None


@functools.cache
def _hook_class():
    """The hook type, made on first use (accelerate imports torch: importing this module stays cheap)."""
    from accelerate.hooks import ModelHook
    from accelerate.utils import send_to_device

    class OnDeviceWhileRunning(ModelHook):
        """accelerate's hook protocol (diffusers reads `execution_device` from it and calls `pre_forward` before
        a VAE's encode/decode too): the component is brought to the GPU before it runs, its inputs with it."""

        def __init__(self, swap: Swap):
            self.swap = swap
            self.execution_device = swap.device

        def pre_forward(self, module, *args, **kwargs):
            self.swap.bring(module)
            return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    return OnDeviceWhileRunning


def apply(pipe, plan: Plan, device: str, dtype=None, add: dict | None = None, streamed: dict | None = None):
    """Put the pipeline (loaded on the CPU unless plan.mode is none) where the plan says; returns the `Swap`
    for `model` and `fp8`. For `fp8`: LoRAs are already in the weights, or in `add` (transformer part -> block
    Linear -> low-rank changes summed as each layer is rounded); `dtype`: the compute dtype. `streamed`: filled
    with what `io.stream.stream` did per component it streamed (how much, page-locked or not)."""
    import torch

    said = streamed if streamed is not None else {}
    if plan.tile_vae:
        pipe.vae.enable_tiling()
    if plan.mode == "none":
        return None
    if plan.mode == "fp8":
        from lorakit.train.quant import quantize_blocks

        on_gpu = str(device).startswith("cuda")
        for name in transformer_parts(pipe):  # Wan 2.2 A14B: both experts
            tr = getattr(pipe, name)
            # one layer at a time on the GPU (fast), each 8-bit layer then kept on the CPU for the swap
            quantize_blocks(tr, dtype or tr.dtype, device if on_gpu else None, (add or {}).get(name))
            if on_gpu:
                tr.to("cpu")
        if not on_gpu:
            return None
        torch.cuda.empty_cache()
    if plan.mode in ("model", "fp8"):
        swap = Swap(device)
        for name, part in pipe.components.items():
            if isinstance(part, torch.nn.Module) and name in plan.streamed:
                said[name] = stream(part, device)
            elif isinstance(part, torch.nn.Module):
                swap.add(part)
        return swap
    # every component's blocks visit from CPU memory one at a time, the rest on the GPU (`io.stream`: the blocks
    # wherever they sit, a text encoder's layers included)
    for name, part in every_step_first(pipe.components):
        if isinstance(part, torch.nn.Module):
            said[name] = stream(part, device)
    return None


def transformer_parts(pipe) -> list[str]:
    """The pipeline's denoising transformers present: `transformer`, and Wan 2.2 A14B's `transformer_2`."""
    import torch

    return [n for n, part in pipe.components.items() if n.startswith("transformer") and
            isinstance(part, torch.nn.Module)]


def every_step_first(components: dict) -> list:
    """The components in the order their host copies are made: the transformer(s) first. Each is page-locked as far
    as the host still has room (`io.pinned.pinnable`), and the transformer's blocks visit every denoising step
    where a text encoder's visit once a prompt: in the pipelines' own order (VAE, text encoder, transformer) a host of
    96 GB would page-lock FLUX.2 [dev]'s 42 GiB Mistral and leave the 59 GiB transformer to a page cache too small for
    it, read again from the disk every step."""
    return sorted(components.items(), key=lambda kv: not kv[0].startswith("transformer"))
