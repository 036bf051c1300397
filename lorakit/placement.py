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


@dataclass
class Plan:
    mode: str  # none | model | fp8 | group
    why: str
    sizes_gib: dict
    streamed: tuple = ()  # model / fp8: text encoders too large to visit whole, their blocks streamed instead


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


def _fits_alone(sizes: dict[str, float], budget_gib: float, transformer_gib: float | None = None) -> bool:
    """Each component on the GPU by itself: the transformer with a denoising forward's room, the others with
    the headroom (a text encoder's forward, a VAE decode)."""
    for name, gib in sizes.items():
        need = (transformer_gib if transformer_gib is not None else gib) + DENOISE_GIB \
            if name == "transformer" else gib + HEADROOM_GIB
        if need > budget_gib:
            return False
    return True


def choose(sizes: dict[str, float], budget_gib: float, mode: str = "auto",
           headroom_gib: float = HEADROOM_GIB, fp8_transformer_gib: float | None = None) -> Plan:
    """`sizes`: each component's GiB at the run's dtype; `fp8_transformer_gib`: the transformer's with fp8
    blocks (`fp8_gib`), None where that is not offered."""
    if mode not in MODES:
        raise InputError(f"--offload {mode}: not one of {', '.join(MODES)}")
    total, largest = sum(sizes.values()), max(sizes.values(), default=0.0)
    if mode != "auto":
        return Plan(mode, f"--offload {mode}", sizes)
    if total + headroom_gib <= budget_gib:
        return Plan("none", f"all weights ({total:.1f} GiB) fit in {budget_gib:.1f} GiB", sizes)
    # a text encoder larger than the card (FLUX.2 [dev]'s 24 B Mistral on a 32 GiB one) runs once per image:
    # its blocks stream while the rest is placed as if it were not there
    streamed = tuple(n for n, gib in sizes.items() if n.startswith("text_encoder") and too_large(gib, budget_gib))
    rest = {n: gib for n, gib in sizes.items() if n not in streamed}
    also = f"; {', '.join(streamed)} streamed block by block" if streamed else ""
    if _fits_alone(rest, budget_gib):
        return Plan("model", f"weights {total:.1f} GiB + {headroom_gib:.1f} GiB to work in > {budget_gib:.1f} GiB: "
                             f"each component on the GPU while it runs (largest {largest:.1f} GiB){also}", sizes,
                    streamed)
    tr = sizes.get("transformer")
    if fp8_transformer_gib is not None and tr is not None and _fits_alone(rest, budget_gib, fp8_transformer_gib):
        return Plan("fp8", f"the transformer ({tr:.1f} GiB) does not fit {budget_gib:.1f} GiB: its block weights "
                           f"in fp8 ({fp8_transformer_gib:.1f} GiB, as the small-card profiles train), each "
                           f"component on the GPU while it runs; images close to bf16's, not equal "
                           f"(--offload group keeps bf16, slower){also}", sizes, streamed)
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
    for `model` and `fp8`. For `fp8`: LoRAs are already in the weights, or in `add` (block Linear ->
    low-rank changes summed as each layer is rounded); `dtype`: the compute dtype. `streamed`: filled with what
    `io.stream.stream` did per component it streamed (how much, page-locked or not)."""
    import torch

    said = streamed if streamed is not None else {}
    if plan.mode == "none":
        return None
    if plan.mode == "fp8":
        from lorakit.train.quant import quantize_blocks

        tr = pipe.transformer
        on_gpu = str(device).startswith("cuda")
        # one layer at a time on the GPU (fast), each 8-bit layer then kept on the CPU for the swap
        quantize_blocks(tr, dtype or tr.dtype, device if on_gpu else None, add)
        if not on_gpu:
            return None
        tr.to("cpu")
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


def every_step_first(components: dict) -> list:
    """The components in the order their host copies are made: the transformer(s) first. Each is page-locked as far
    as the host still has room (`io.pinned.pinnable`), and the transformer's blocks visit every denoising step
    where a text encoder's visit once a prompt: in the pipelines' own order (VAE, text encoder, transformer) a host of
    96 GB would page-lock FLUX.2 [dev]'s 42 GiB Mistral and leave the 59 GiB transformer to a page cache too small for
    it, read again from the disk every step."""
    return sorted(components.items(), key=lambda kv: not kv[0].startswith("transformer"))
