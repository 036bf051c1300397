"""The attention self-test inside the families' real transformer blocks.

A bare SDPA call can pass where the same kernel fails inside a model: on an H100 (torch 2.11, cuDNN
9.19) cuDNN attention passes every standalone forward+backward lorakit tried, yet inside the FLUX
transformer with gradient checkpointing it corrupts memory (the next cuBLAS call fails). So the
self-test also runs backends through each architecture's real diffusers transformer class — full width
and heads, one block of each kind (the family adapter's `attention_model_config`), random bf16 weights
built on the GPU, frozen like a LoRA base, with gradient checkpointing — at 1024², called exactly as
training calls it (`adapter.predict`), with a padded text mask where the family passes one, and its input
gradient is compared with a reference kernel's (flash attention; memory-efficient where the family masks text).
"""

from __future__ import annotations

import time

from lorakit.hardware.attention_cases import CaseResult, error_line
from lorakit.hardware.sdpa import apply, restore
from lorakit.io.modules import keep_fp32
from lorakit.models.base import arch_adapter


def _build(case: str, device: str, dtype):
    """(adapter, transformer, inputs) of an architecture's model case, "model <arch>"."""
    import diffusers
    import torch

    adapter = arch_adapter(case.removeprefix("model "))
    config = adapter.attention_model_config()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 (a later whole-model .to(dtype) would warn)
    try:
        with torch.device(device):
            model = getattr(diffusers, adapter.info.transformer_class)(**config)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator().manual_seed(0)
    batch = adapter.example_inputs(config, 1024, 512, g)
    text = {k: v.to(device) for k, v in batch.text.items()}
    if "prompt_embeds_mask" in text:  # padded text, as a batch of prompts of different lengths gives
        text["prompt_embeds_mask"][:, int(text["prompt_embeds_mask"].shape[1] * 0.8):] = 0
    text = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in text.items()}
    x = batch.latents.to(device, dtype).requires_grad_(True)
    controls = [c.to(device, dtype) for c in batch.controls]
    return adapter, keep_fp32(model).eval().requires_grad_(False), (x, text, controls)


GRAD_TOLERANCE = 0.05  # relative difference of the input gradient from the reference kernel's (bf16: <= 0.01)


def run_model_case(case: str, backend: str | None, device: str = "cuda", repeats: int = 2):
    """Forward+backward of one architecture's real transformer blocks (checkpointed) with one SDPA backend in
    force (None: PyTorch's own pick), then once with the reference kernel (flash attention; memory-efficient
    attention where the family masks its text): a backend passes when its gradients are finite and within
    GRAD_TOLERANCE of the reference's (a kernel can be wrong without a NaN). A reference that cannot run here
    judges nothing.

    Returns:
        a `CaseResult` (ok, median ms, or the error).
    """
    import torch

    name = backend or "default"
    prev = apply(None)  # the switches as they are, for `restore`
    try:
        apply(backend)  # inside the try: a backend that cannot be put in force here (fa4) is a failed case
        adapter, model, (x, text, controls) = _build(case, device, torch.bfloat16)
        model.enable_gradient_checkpointing()
        sigma = torch.tensor([0.5], device=device)

        def input_grad():
            out = adapter.predict(model, x, sigma, text, guidance=3.5, controls=controls)
            out.float().square().mean().backward()
            grad, x.grad = x.grad.float(), None
            return grad

        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            grad = input_grad()
            torch.cuda.synchronize(device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
            if not torch.isfinite(grad).all():
                return CaseResult(name, case, False, error="non-finite gradients")
        reference = "efficient" if any(c.masked for c in adapter.attention_cases) else "flash"
        diff = None if backend == reference else _away(grad, input_grad, reference)  # the reference itself: as is
        if diff is not None and not diff <= GRAD_TOLERANCE:
            return CaseResult(name, case, False, error=f"gradients {diff:.1%} away from {reference} attention's "
                                                      f"(bf16 kernels agree within {GRAD_TOLERANCE:.0%})")
        times.sort()
        return CaseResult(name, case, True, ms=round(times[len(times) // 2], 3))
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        return CaseResult(name, case, False, error=error_line(e))
    finally:
        restore(prev)


def _away(grad, input_grad, reference: str) -> float | None:
    """The relative difference of `grad` from the input gradient with the `reference` kernel in force; None
    where the reference cannot give one here."""
    import torch

    try:
        apply(reference)
        ref = input_grad()
    except Exception:  # noqa: BLE001 - the reference judges only where it runs
        return None
    if not torch.isfinite(ref).all():
        return None
    return ((grad - ref).norm() / ref.norm().clamp_min(1e-12)).item()
