"""FlashAttention 4 under SDPA (opt-in: `memory.attention: fa4`).

The flash-attn-4 package's CuTe-DSL kernels (Hopper, datacenter Blackwell) are put in place of PyTorch's own
flash kernel through torch's flash attention registry (torch 2.10+), so every SDPA call of a run — forward,
backward, the recompute of a checkpointed block, compiled blocks — uses them, and the rest of lorakit (and
diffusers' attention code) is unchanged.

torch's glue calls the package's `_flash_attn_fwd` / `_flash_attn_bwd` and expects the forward to return
(out, lse); flash-attn-4 4.0.0b36 returns five values. This module is the glue's module: it forwards to the
package and hands back the two values torch expects, whichever release is installed.
"""

from __future__ import annotations

from lorakit.errors import NotAvailableError

IMPL = "FA4 (lorakit)"  # the name lorakit registers its glue under in torch's registry


def installed() -> str | None:
    """The installed flash-attn-4 version (None: not installed); cheap (no import of the package or torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return None


def candidate(fingerprint: dict) -> bool:
    """Should the attention self-test measure fa4 on the machine of this fingerprint (`attention.fingerprint`)?
    Cheap: from the probe's facts and package metadata; the measurement itself (in a child process) is what
    decides whether it is used."""
    torch_v = tuple(int(x) for x in str(fingerprint.get("torch") or "0.0").split("+")[0].split(".")[:2]
                    if x.isdigit())
    cap = str(fingerprint.get("capability") or "")
    return bool(fingerprint.get("fa4")) and torch_v >= (2, 10) and cap.split(".")[0] in ("9", "10")


def preimport() -> None:
    """Import the package before a self-test child says it is ready (it takes ~10 s: the watchdog is for the
    kernels, not the imports). Failures are left to the case, which reports them."""
    if installed():
        try:
            import flash_attn.cute.interface  # noqa: F401
        except Exception:  # noqa: BLE001, S110 - the fa4 case will report why
            pass


def problem(device: str = "cuda") -> str | None:
    """Why SDPA's flash path cannot run FlashAttention 4 here (None: it can)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return "attention fa4 runs on CUDA GPUs only"
    import torch.nn.attention as A

    try:
        from torch.nn.attention import _fa4  # noqa: F401
    except ImportError:
        _fa4 = None
    if not hasattr(A, "activate_flash_attention_impl") or _fa4 is None:
        return f"attention fa4 needs torch 2.10 or newer (its flash attention registry); this is {torch.__version__}"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major not in (9, 10):
        return (f"attention fa4 runs on Hopper and datacenter Blackwell (compute capability 9.0 / 10.x); "
                f"{torch.cuda.get_device_name(torch.device(device))} is {major}.{minor}")
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here", said with its reason
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"attention fa4 needs the flash-attn-4 package (pip install flash-attn-4): {type(e).__name__}: {msg}"
    return None


def active() -> bool:
    try:
        import torch.nn.attention as A
    except ImportError:
        return False
    return getattr(A, "current_flash_attention_impl", lambda: None)() == IMPL


def activate() -> None:
    """Route SDPA's flash path through FlashAttention 4 (raises NotAvailableError with the reason if it
    cannot run here)."""
    if active():
        return
    why = problem()
    if why:
        raise NotAvailableError(why, "--set memory.attention=auto")
    import torch.nn.attention as A
    from torch.nn.attention import _fa4

    if IMPL not in A.list_flash_attention_impls():
        A.register_flash_attention_impl(
            IMPL, register_fn=lambda: _fa4.register_flash_attention_fa4(module_path=__name__))
    A.activate_flash_attention_impl(IMPL)


def deactivate() -> None:
    """Back to PyTorch's own flash kernel."""
    if active():
        import torch.nn.attention as A

        A.restore_flash_attention_impl()


# --------------------------------------------------------------------------- the glue torch calls


def _flash_attn_fwd(*args, **kwargs):
    from flash_attn.cute import interface

    res = interface._flash_attn_fwd(*args, **kwargs)
    return res[0], res[1]  # out, lse (newer releases add p, row_max, o_lo)


def _flash_attn_bwd(*args, **kwargs):
    from flash_attn.cute import interface

    res = interface._flash_attn_bwd(*args, **kwargs)
    return res[0], res[1], res[2]  # dq, dk, dv
