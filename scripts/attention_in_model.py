"""GPU check: does the attention choice of `lorakit doctor` hold inside the real diffusers transformers?

Builds FLUX.1-dev- and Qwen-Image-width transformers (full width and heads, fewer blocks, random bf16
weights, no download), runs forward + backward with gradient checkpointing at 1024² with PyTorch's default SDPA choice and with
each backend put in force by `lorakit.hardware.attention.apply`, each in its own process, and marks the
backend `lorakit doctor` chose. The choice must pass.

    python scripts/attention_in_model.py [--blocks 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def flux_case(blocks: int):
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=2 * blocks,
                               attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                               pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    img, txt = 4096, 512
    ids = torch.zeros(img, 3)
    ids[:, 1] = torch.arange(img) // 64
    ids[:, 2] = torch.arange(img) % 64

    def inputs(dev, dt):
        return dict(hidden_states=torch.randn(1, img, 64, device=dev, dtype=dt),
                    encoder_hidden_states=torch.randn(1, txt, 4096, device=dev, dtype=dt),
                    pooled_projections=torch.randn(1, 768, device=dev, dtype=dt),
                    timestep=torch.tensor([0.5], device=dev, dtype=dt), img_ids=ids.to(dev),
                    txt_ids=torch.zeros(txt, 3, device=dev), guidance=torch.tensor([3.5], device=dev, dtype=dt),
                    return_dict=False)
    return m, inputs


def qwen_case(blocks: int):
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=blocks,
                                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                    guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    img, txt = 4096, 300

    def inputs(dev, dt):
        mask = torch.ones(1, txt, device=dev, dtype=torch.long)
        mask[:, 250:] = 0
        return dict(hidden_states=torch.randn(1, img, 64, device=dev, dtype=dt),
                    encoder_hidden_states=torch.randn(1, txt, 3584, device=dev, dtype=dt),
                    encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5], device=dev, dtype=dt),
                    img_shapes=[[(1, 64, 64)]], return_dict=False)
    return m, inputs


def step(model, inputs) -> tuple[bool, str, float]:
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(**inputs)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        model.zero_grad(set_to_none=True)
        return (not bad), ("non-finite grads" if bad else "ok"), dt
    except Exception as e:  # noqa: BLE001 - the failure is the result
        model.zero_grad(set_to_none=True)
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}", 0.0


def run_one(family: str, backend: str | None, blocks: int) -> dict:
    """One family x attention setting (run in its own process: a CUDA error poisons the context)."""
    from lorakit.hardware import attention as att

    build = {"flux": flux_case, "qwen-image": qwen_case}[family]
    model, make = build(blocks)
    model = model.to("cuda", torch.bfloat16).requires_grad_(True)
    model.enable_gradient_checkpointing()
    att.apply(backend)
    ok, msg, _ = step(model, make("cuda", torch.bfloat16))  # warm-up
    times = []
    for _ in range(3):
        if not ok:
            break
        ok, msg, dt = step(model, make("cuda", torch.bfloat16))
        times.append(dt)
    return {"family": family, "backend": backend or "pytorch default", "ok": ok, "result": msg,
            "s_median": round(sorted(times)[len(times) // 2], 4) if times else None}


def main() -> None:
    import subprocess
    import sys

    from lorakit.hardware import attention as att

    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=2, metavar=("FAMILY", "BACKEND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], None if a.one[1] == "default" else a.one[1], a.blocks)))
        return
    report = att.self_test("cuda")
    rows = []
    for family in ("flux", "qwen-image"):
        for backend in ("default", *att.BACKENDS):
            p = subprocess.run([sys.executable, __file__, "--blocks", str(a.blocks), "--one", family, backend],
                               capture_output=True, text=True, timeout=900)
            try:
                row = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
                row = {"family": family, "backend": backend, "ok": False, "result": f"process died: {tail}",
                       "s_median": None}
            row["lorakit_choice"] = backend == report.choice[family]
            rows.append(row)
            mark = "<- lorakit's choice" if row["lorakit_choice"] else ""
            print(f"{family:11s} {row['backend']:16s} {'PASS' if row['ok'] else 'FAIL'} "
                  f"{row['s_median'] or 0:7.3f}s  {row['result'][:90]} {mark}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"self_test": report.to_dict(), "in_model": rows}, f, indent=2)


if __name__ == "__main__":
    main()
