"""The dtype names configs and command options use (bf16 | fp16 | fp32)."""

from __future__ import annotations

NAMES = ("bf16", "fp16", "fp32")


def torch_dtype(name: str):
    """bf16 | fp16 | fp32 -> the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def slow_on_cpu(device: str, dtype) -> bool:
    """Does this CPU run bf16 / fp16 convolutions without fast kernels? Where oneDNN has no bf16 path (no
    AVX512-BF16 or AMX: most desktop and many server CPUs), a bf16 conv2d runs ~60x slower than in float32
    (1024² x 16 channels, one thread, AMD EPYC with AVX2: 16.0 s against 0.24 s, 2026-11-28)."""
    import torch

    if not str(device).startswith("cpu") or dtype not in (torch.bfloat16, torch.float16):
        return False
    fast = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else \
        torch.ops.mkldnn._is_mkldnn_fp16_supported
    return not fast()


def float32_inside(module) -> None:
    """Run `module` in float32 while its callers see the dtype it had: its weights become float32 and each direct
    submodule (a VAE's encoder, decoder, quant convs) takes its tensor inputs in float32 and gives its tensor
    outputs back in the input's dtype — a pipeline that feeds bf16 latents and expects bf16 back runs unchanged."""
    import torch

    def _cast(x, dtype):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    def pre(mod, args, kwargs):
        mod._lorakit_in = next((a.dtype for a in (*args, *kwargs.values()) if torch.is_tensor(a)
                                and a.is_floating_point()), None)
        return tuple(_cast(a, torch.float32) for a in args), {k: _cast(v, torch.float32) for k, v in kwargs.items()}

    def post(mod, args, kwargs, out):
        dtype = mod.__dict__.pop("_lorakit_in", None)
        if dtype is None or dtype == torch.float32:
            return out
        return tuple(_cast(o, dtype) for o in out) if isinstance(out, tuple) else _cast(out, dtype)

    module.to(torch.float32)
    for child in module.children():
        child.register_forward_pre_hook(pre, with_kwargs=True)
        child.register_forward_hook(post, with_kwargs=True)
