"""PyTorch's SDPA backends, and putting one in force for a whole run.

A `with sdpa_kernel(...)` scope around the forward alone does not cover the recompute of a checkpointed block,
which runs in backward outside the scope (and then picks another kernel whose saved tensors differ). So lorakit
puts its choice in force with PyTorch's *global* SDPA switches (`apply`), which hold in forward, backward and
recompute alike.
"""

from __future__ import annotations

from lorakit.errors import UnknownNameError
from lorakit.hardware import fa4

BACKENDS = ("flash", "efficient", "cudnn", "math")  # PyTorch's own
ALL_BACKENDS = BACKENDS + ("fa4",)  # fa4: SDPA's flash path through flash-attn-4 (`lorakit.hardware.fa4`)


def sdp_backend(name: str):
    """PyTorch's SDPBackend of one of BACKENDS."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def apply(backend: str | None, fallback: bool = False) -> dict:
    """Put one SDPA backend in force globally (forward, backward and recompute alike).

    `fallback`: keep the math backend on as the last resort for attention calls the chosen kernel cannot
    take at all. The self-test showed the chosen kernel takes every call of the family's transformer, so
    PyTorch never picks math there; the VAEs' single 512-wide head (FLUX) or 384-wide (Qwen-Image) in the
    sample decode is such a call, and with every other backend off PyTorch fails it ("Invalid backend").

    Returns:
        the previous switch states, for `restore`.
    """
    import torch

    b = torch.backends.cuda
    prev = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled(), "fa4": fa4.active()}
    if backend is None:
        return prev
    names = backend.split("+")  # "flash+efficient": flash where it can (no mask), efficient where not
    for n in names:
        if n not in ALL_BACKENDS:
            raise UnknownNameError("attention backend", n, list(ALL_BACKENDS))
    fa4.activate() if "fa4" in names else fa4.deactivate()
    b.enable_flash_sdp("flash" in names or "fa4" in names)
    b.enable_mem_efficient_sdp("efficient" in names)
    b.enable_cudnn_sdp("cudnn" in names)
    b.enable_math_sdp("math" in names or fallback)
    return prev


def restore(prev: dict) -> None:
    """Undo `apply`."""
    import torch

    b = torch.backends.cuda
    b.enable_flash_sdp(prev["flash"])
    b.enable_mem_efficient_sdp(prev["efficient"])
    b.enable_cudnn_sdp(prev["cudnn"])
    b.enable_math_sdp(prev["math"])
    fa4.activate() if prev.get("fa4") else fa4.deactivate()
