"""The attention self-test inside the families' real transformer blocks.

A bare SDPA call can pass where the same kernel fails inside a model: on an H100 (torch 2.11, cuDNN
9.19) cuDNN attention passes every standalone forward+backward lorakit tried, yet inside the FLUX
transformer with gradient checkpointing it corrupts memory (the next cuBLAS call fails). So the
self-test also runs each backend through the real diffusers transformer classes — full width and
heads, one block of each kind, random bf16 weights built on the GPU, frozen like a LoRA base, with
gradient checkpointing — at 1024².
"""

from __future__ import annotations

import time

MODEL_CASES = ("model flux", "model qwen-image")


def _flux(device, dtype):
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    img, txt = 4096, 512
    ids = torch.zeros(img, 3, device=device)
    ids[:, 1] = torch.arange(img, device=device) // 64
    ids[:, 2] = torch.arange(img, device=device) % 64
    g = torch.Generator(device=device).manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, img, 64, device=device, dtype=dtype, generator=g),
                  encoder_hidden_states=torch.randn(1, txt, 4096, device=device, dtype=dtype, generator=g),
                  pooled_projections=torch.randn(1, 768, device=device, dtype=dtype, generator=g),
                  timestep=torch.tensor([0.5], device=device, dtype=dtype), img_ids=ids,
                  txt_ids=torch.zeros(txt, 3, device=device), guidance=torch.tensor([3.5], device=device, dtype=dtype),
                  return_dict=False)
    return m, inputs


def _qwen_image(device, dtype):
    import torch
    from diffusers import QwenImageTransformer2DModel

    with torch.device(device):
        m = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=1,
                                        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                        guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    img, txt = 4096, 300
    g = torch.Generator(device=device).manual_seed(0)
    mask = torch.ones(1, txt, device=device, dtype=torch.long)
    mask[:, 250:] = 0  # padded text, as a batch of prompts of different lengths gives
    inputs = dict(hidden_states=torch.randn(1, img, 64, device=device, dtype=dtype, generator=g),
                  encoder_hidden_states=torch.randn(1, txt, 3584, device=device, dtype=dtype, generator=g),
                  encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5], device=device, dtype=dtype),
                  img_shapes=[[(1, 64, 64)]], return_dict=False)
    return m, inputs


_BUILDERS = {"model flux": _flux, "model qwen-image": _qwen_image}


def run_model_case(case: str, backend: str, device: str = "cuda", repeats: int = 2):
    """Forward+backward of one real transformer (checkpointed) with one SDPA backend in force.

    Returns:
        a `CaseResult` (ok, median ms, or the error).
    """
    import torch

    from lorakit.hardware.attention import CaseResult, apply, restore

    prev = apply(backend)
    try:
        model, inputs = _BUILDERS[case](device, torch.bfloat16)
        model = model.to(torch.bfloat16).eval().requires_grad_(False)
        model.enable_gradient_checkpointing()
        x = inputs["hidden_states"].requires_grad_(True)
        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = model(**inputs)[0]
            out.float().square().mean().backward()
            torch.cuda.synchronize(device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
            if not torch.isfinite(x.grad).all():
                return CaseResult(backend, case, False, error="non-finite gradients")
            x.grad = None
        times.sort()
        return CaseResult(backend, case, True, ms=round(times[len(times) // 2], 3))
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CaseResult(backend, case, False, error=f"{type(e).__name__}: {msg[:300]}")
    finally:
        restore(prev)
