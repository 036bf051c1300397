"""Attention backend self-test, and putting the chosen backend in force for a whole run.

Why: on an H100 with torch 2.11 + cuDNN 9.19, PyTorch's default SDPA pick for FLUX (cuDNN attention)
crashes in backward, and a `with sdpa_kernel(...)` scope around the forward alone does not cover the
recompute of a checkpointed block, which runs in backward outside the scope. So lorakit:

1. runs forward AND backward of every backend at the families' shapes (`self_test`), caching the
   result per machine fingerprint;
2. chooses per family the fastest backend that worked at all of that family's shapes (`choose`);
3. puts the choice in force with PyTorch's *global* SDPA switches (`apply`), which hold in forward,
   backward and recompute alike, because no scope ends before backward runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BACKENDS = ("flash", "efficient", "cudnn", "math")

# (name, sequence length, masked) — head_dim 128, 24 heads, as FLUX/Qwen-Image/Kandinsky 5 use.
# 512² training: 1024 image tokens + 512 text; 1024²: 4096 + 512.
CASES = (("512px", 1536, False), ("1024px", 4608, False), ("512px+mask", 1536, True), ("1024px+mask", 4608, True))

# Which cases matter for which family: Qwen-Image passes an attention mask (text padding); FLUX and
# Kandinsky 5 do not.
FAMILY_MASKED = {"flux": False, "qwen-image": True, "qwen-image-edit": True, "qwen-image-edit-plus": True,
                 "kandinsky5-t2i": False, "kandinsky5-t2v": False}


@dataclass
class CaseResult:
    backend: str
    case: str
    ok: bool
    ms: float | None = None  # median forward+backward time
    error: str | None = None


@dataclass
class AttentionReport:
    fingerprint: dict
    results: list[CaseResult] = field(default_factory=list)
    choice: dict[str, str | None] = field(default_factory=dict)  # family -> backend
    cached: bool = False

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "results": [asdict(r) for r in self.results],
                "choice": self.choice, "cached": self.cached}

    @classmethod
    def from_dict(cls, d: dict) -> AttentionReport:
        return cls(fingerprint=d["fingerprint"], results=[CaseResult(**r) for r in d["results"]],
                   choice=d["choice"], cached=True)


def _sdp_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def fingerprint(device: str = "cuda") -> dict:
    """What the self-test result depends on: GPU, driver, torch, CUDA, cuDNN."""
    import torch

    from lorakit.hardware.probe import _driver_version

    fp = {"torch": torch.__version__, "cuda": torch.version.cuda,
          "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
          "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        fp.update(gpu=p.name, capability=f"{p.major}.{p.minor}", driver=_driver_version())
    else:
        import platform

        fp.update(gpu=None, cpu=platform.processor() or platform.machine())
    return fp


def _cache_file(fp: dict) -> Path:
    base = os.environ.get("LORAKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lorakit")
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / "attention" / f"{key}.json"


def _run_case(backend: str, seq: int, masked: bool, device: str, dtype, heads: int, head_dim: int,
              repeats: int) -> CaseResult:
    """Forward + backward of one backend, with tensors laid out as the diffusers transformers lay them out.

    diffusers projects q/k/v to (batch, seq, heads, head_dim) and permutes them to (batch, heads, seq,
    head_dim) for SDPA, then permutes the output back and flattens the heads: the kernels see strided
    inputs and a strided output gradient. Contiguous tensors would pass where the real model fails.
    """
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(1, seq, heads, head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(3)]
    weight = torch.randn(1, seq, heads * head_dim, device=device, dtype=torch.float32, generator=g)
    mask = None
    if masked:  # the last 10% of keys are padding, as with padded text
        keep = torch.ones(seq, dtype=torch.bool, device=device)
        keep[int(seq * 0.9):] = False
        mask = keep[None, None, None, :]
    times = []
    try:
        with sdpa_kernel([_sdp_backend(backend)]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "kernel not used because ..." is what we record
            for i in range(repeats + 1):
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                q, k, v = (t.permute(0, 2, 1, 3) for t in base)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out = out.permute(0, 2, 1, 3).reshape(1, seq, heads * head_dim)
                (out.float() * weight).mean().backward()
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                if i:  # the first run is warm-up
                    times.append((time.perf_counter() - t0) * 1e3)
                if not all(torch.isfinite(t.grad).all() for t in base):
                    return CaseResult(backend, "", False, error="non-finite gradients")
                for t in base:
                    t.grad = None
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CaseResult(backend, "", False, error=f"{type(e).__name__}: {msg[:300]}")
    times.sort()
    return CaseResult(backend, "", True, ms=round(times[len(times) // 2], 3))


def self_test(device: str = "cuda", use_cache: bool = True, repeats: int = 5, heads: int = 24,
              head_dim: int = 128, cases=CASES) -> AttentionReport:
    """Run forward+backward of every SDPA backend at the families' shapes; cached per fingerprint."""
    import torch

    fp = fingerprint(device)
    fp.update(heads=heads, head_dim=head_dim, cases=[c[0] for c in cases])
    path = _cache_file(fp)
    if use_cache and path.is_file():
        try:
            return AttentionReport.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is simply re-measured
    dtype = torch.bfloat16
    report = AttentionReport(fingerprint=fp)
    for backend in BACKENDS:
        for name, seq, masked in cases:
            r = _run_case(backend, seq, masked, device, dtype, heads, head_dim, repeats)
            r.case = name
            report.results.append(r)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    report.choice = {fam: choose(report, fam) for fam in FAMILY_MASKED}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-run
    return report


def choose(report: AttentionReport, family: str) -> str | None:
    """Fastest backend that passed every case relevant to a family (None if none did)."""
    masked = FAMILY_MASKED.get(family, False)
    relevant = {c[0] for c in CASES if c[2] == masked}
    best, best_ms = None, None
    for backend in BACKENDS:
        rs = [r for r in report.results if r.backend == backend and r.case in relevant]
        if not rs or not all(r.ok for r in rs):
            continue
        total = sum(r.ms or 0.0 for r in rs)
        if best_ms is None or total < best_ms:
            best, best_ms = backend, total
    return best


def apply(backend: str | None) -> dict:
    """Put one SDPA backend in force globally (forward, backward and recompute alike).

    Returns:
        the previous switch states, for `restore`.
    """
    import torch

    b = torch.backends.cuda
    prev = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}
    if backend is None:
        return prev
    if backend not in BACKENDS:
        from lorakit.errors import UnknownNameError

        raise UnknownNameError("attention backend", backend, list(BACKENDS))
    b.enable_flash_sdp(backend == "flash")
    b.enable_mem_efficient_sdp(backend == "efficient")
    b.enable_cudnn_sdp(backend == "cudnn")
    b.enable_math_sdp(backend == "math")
    return prev


def restore(prev: dict) -> None:
    """Undo `apply`."""
    import torch

    b = torch.backends.cuda
    b.enable_flash_sdp(prev["flash"])
    b.enable_mem_efficient_sdp(prev["efficient"])
    b.enable_cudnn_sdp(prev["cudnn"])
    b.enable_math_sdp(prev["math"])
