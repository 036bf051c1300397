"""Can this GPU multiply in fp8 the way `memory.compute: fp8` does (`train.quant.fp8_linear`)? Asked before a
model loads: to refuse `fp8` with the reason, and to settle `auto` (fp8 where it runs, else bf16)."""

from __future__ import annotations

import torch


def fp8_compute_problem(device: str) -> str | None:
    """Why this device cannot multiply in fp8 (None: it can). CPUs run `torch._scaled_mm` as a reference (slow).

    A GPU with fp8 units is also asked to run the two products `fp8_linear` runs, on 16x32 operands: some
    PyTorch builds have no per-row-scaled fp8 product for some GPUs (cuBLAS answered NOT_SUPPORTED for
    Blackwell's sm_120 in PyTorch 2.10, pytorch/pytorch#192707) — said here, before the model loads, rather
    than as a CUDA error in the first step."""
    if not device.startswith("cuda"):
        return None
    dev = torch.device(device)
    cap, name = torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev)
    if cap < (8, 9):
        return (f"memory.compute=fp8 needs fp8 matrix units (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{name} is {cap[0]}.{cap[1]}")
    try:
        got = products_of_ones(dev)
        torch.cuda.empty_cache()  # nothing of the probe's stays cached: a run sets its allocator (expandable
        # segments, the cap) after this check, and the segments it then makes follow those settings
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return (f"memory.compute=fp8: PyTorch {torch.__version__} cannot multiply fp8 with per-row scales on "
                f"{name} (compute capability {cap[0]}.{cap[1]}): {first}")
    if got != [32.0, 16.0]:
        return (f"memory.compute=fp8: PyTorch {torch.__version__}'s fp8 product gives wrong values on {name} "
                f"(all-ones 16x32 operands: {got}, not [32.0, 16.0])")
    return None


def products_of_ones(device) -> list[float]:
    """The forward and input-gradient products of `fp8_linear`, in its argument forms, on all-ones operands
    (x 16x32 in e4m3 with a scale per row, W 16x32 in e4m3 with a scale per row; the gradient 16x16 in e5m2,
    the transposed weight): the entries they give (32 and 16 when right)."""
    w8 = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    x8 = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    rows = torch.ones(16, 1, device=device, dtype=torch.float32)
    y = torch._scaled_mm(x8, w8.t(), scale_a=rows, scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    g8 = torch.ones(16, 16, device=device).to(torch.float8_e5m2)
    w8_t = w8.t().contiguous()
    gx = torch._scaled_mm(g8, w8_t.t(), scale_a=rows, scale_b=torch.ones(1, 32, device=device),
                          out_dtype=torch.bfloat16, use_fast_accum=True)
    return [float(y.float().mean()), float(gx.float().mean())]
