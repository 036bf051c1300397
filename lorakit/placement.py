"""Where a pipeline's weights live while it generates: all on the GPU when they fit, else each component
moved to the GPU only while it runs (diffusers' model offload), else the transformer's blocks streamed from
pinned CPU memory one group at a time, overlapped with compute (diffusers' group offload). The choice comes
from the weight sizes in the safetensors headers and the card's memory (or LORAKIT_MEMORY_CAP_GIB), before
anything is loaded; `--offload` forces one. Outputs are the same in every mode (the weights are not changed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import InputError

MODES = ("auto", "none", "model", "group")
# activations of one 1024² generation plus the VAE decode (FLUX ~3, Qwen-Image ~4 GiB measured on the H100),
# the LoRA and the allocator's slack
HEADROOM_GIB = 5.0
FLOATS = ("BF16", "F16", "F32", "F64")


@dataclass
class Plan:
    mode: str  # none | model | group
    why: str
    sizes_gib: dict


def component_gib(model_dir: Path, names, dtype_bytes: int) -> dict[str, float]:
    """Each weight component's size in GiB at `dtype_bytes` per floating-point element (from its headers)."""
    from lorakit.io.header import read_header
    from lorakit.io.reader import resolve_files

    out = {}
    for name in names:
        folder = Path(model_dir) / name
        if not folder.is_dir() or not any(folder.glob("*.safetensors*")):
            continue
        total = 0
        for f in resolve_files(folder):
            for info in read_header(f).tensors.values():  # floats load at the run's dtype, the rest as stored
                total += math.prod(info.shape) * dtype_bytes if info.dtype in FLOATS else info.nbytes
        out[name] = round(total / 2**30, 2)
    return out


def choose(sizes: dict[str, float], budget_gib: float, mode: str = "auto",
           headroom_gib: float = HEADROOM_GIB) -> Plan:
    if mode not in MODES:
        raise InputError(f"--offload {mode}: not one of {', '.join(MODES)}")
    total, largest = sum(sizes.values()), max(sizes.values(), default=0.0)
    if mode != "auto":
        return Plan(mode, f"--offload {mode}", sizes)
    if total + headroom_gib <= budget_gib:
        return Plan("none", f"all weights ({total:.1f} GiB) fit in {budget_gib:.1f} GiB", sizes)
    if largest + headroom_gib <= budget_gib:
        return Plan("model", f"weights {total:.1f} GiB > {budget_gib:.1f} GiB: each component on the GPU while it "
                             f"runs (largest {largest:.1f} GiB)", sizes)
    return Plan("group", f"the largest component ({largest:.1f} GiB) does not fit {budget_gib:.1f} GiB with "
                         f"{headroom_gib:g} GiB to work in: its blocks stream from CPU memory", sizes)


def budget_gib(device: str) -> float:
    """The memory this process may use on `device`: LORAKIT_MEMORY_CAP_GIB, else the card's total."""
    from lorakit.train.memory import env_cap_gib

    cap = env_cap_gib()
    if cap:
        return float(cap)
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory / 2**30


def apply(pipe, plan: Plan, device: str) -> None:
    """Put the pipeline (loaded on the CPU unless plan.mode is none) where the plan says."""
    import torch

    if plan.mode == "none":
        return
    if plan.mode == "model":
        pipe.enable_model_cpu_offload(device=device)
        return
    # every component's blocks stream from pinned CPU memory, the next group prefetched on a side stream
    pipe.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                              offload_type="block_level", num_blocks_per_group=1, use_stream=True)
