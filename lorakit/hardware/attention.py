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

# (name, sequence length, masked, layout) — head_dim 128, 24 heads, as FLUX/Qwen-Image/Kandinsky 5 use.
# 512² training: 1024 image tokens + 512 text; 1024²: 4096 + 512.
# layout "joint": the output feeds its own projection (dual-stream blocks), so the output gradient is
# contiguous; "single": the output is concatenated with the MLP branch before one projection (FLUX's
# single-stream blocks), so the output gradient is a strided slice of a wider tensor.
CASES = (("512px", 1536, False, "joint"), ("1024px", 4608, False, "joint"),
         ("512px single", 1536, False, "single"), ("1024px single", 4608, False, "single"),
         ("512px+mask", 1536, True, "joint"), ("1024px+mask", 4608, True, "joint"))

# The cases that matter for each family: Qwen-Image passes an attention mask (text padding) and has
# only dual-stream blocks; FLUX has no mask and both block kinds. On CUDA each family also needs its
# real transformer to pass ("model ..." cases, lorakit.hardware.attention_model); Kandinsky 5 (no mask,
# head_dim 128) borrows FLUX's model check.
FAMILY_CASES = {
    "flux": ("512px", "1024px", "512px single", "1024px single", "model flux"),
    "qwen-image": ("512px+mask", "1024px+mask", "model qwen-image"),
    "qwen-image-edit": ("512px+mask", "1024px+mask", "model qwen-image"),
    "qwen-image-edit-plus": ("512px+mask", "1024px+mask", "model qwen-image"),
    "kandinsky5-t2i": ("512px", "1024px", "model flux"),
    "kandinsky5-t2v": ("512px", "1024px", "model flux"),
}
FAMILY_MASKED = {f: any("mask" in c for c in cases) for f, cases in FAMILY_CASES.items()}


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


def _run_case(backend: str, seq: int, masked: bool, layout: str, device: str, dtype, heads: int,
              head_dim: int, repeats: int) -> CaseResult:
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
    width = heads * head_dim * (5 if layout == "single" else 1)  # single: attention (1x) + MLP (4x)
    weight = torch.randn(1, seq, width, device=device, dtype=torch.float32, generator=g)
    mlp = torch.randn(1, seq, width - heads * head_dim, device=device, dtype=dtype, generator=g)
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
                if layout == "single":
                    out = torch.cat([out, mlp], dim=2)
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


def _run_backend(backend: str, device: str, repeats: int, heads: int, head_dim: int, cases,
                 models: tuple = ()) -> list[CaseResult]:
    """All cases of one backend in this process (then the real-model cases). After a CUDA error the
    context is unusable, so the remaining cases are recorded as not run rather than attempted."""
    import torch

    from lorakit.hardware.attention_model import run_model_case

    out: list[CaseResult] = []
    lost = None
    todo = [(c[0], c) for c in cases] + [(m, None) for m in models]
    for name, raw in todo:
        if lost:
            out.append(CaseResult(backend, name, False, error=f"not run: the CUDA context was lost at {lost}"))
            continue
        if raw is not None:
            _, seq, masked, layout = raw
            r = _run_case(backend, seq, masked, layout, device, torch.bfloat16, heads, head_dim, repeats)
        else:
            r = run_model_case(name, backend, device, repeats=repeats)
        r.case = name
        out.append(r)
        if not r.ok and any(s in (r.error or "") for s in ("CUDA error", "AcceleratorError", "CUBLAS_STATUS")):
            lost = name
        if device.startswith("cuda") and not lost:
            torch.cuda.empty_cache()
    return out


def _run_backend_isolated(backend: str, device: str, repeats: int, heads: int, head_dim: int,
                          cases, models: tuple = (), timeout: float | None = None) -> list[CaseResult]:
    """One backend in a child process: a kernel that corrupts the GPU context (illegal memory access,
    as cuDNN attention does inside FLUX on some stacks) cannot take the other results down with it."""
    import subprocess
    import sys

    args = json.dumps({"backend": backend, "device": device, "repeats": repeats, "heads": heads,
                       "head_dim": head_dim, "cases": [list(c) for c in cases], "models": list(models)})
    # A kernel that corrupts memory can also hang the process: a few minutes is far beyond any healthy run
    # (about 10 s here), so a child that has not answered by then is a failure, not something to wait on.
    timeout = timeout if timeout is not None else 60 + 20 * (len(cases) + 2 * len(models))
    try:
        p = subprocess.run([sys.executable, "-m", "lorakit.hardware.attention", args], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [CaseResult(backend, n, False, error=f"hung: no answer in {timeout:.0f} s")
                for n in [c[0] for c in cases] + list(models)]
    try:
        return [CaseResult(**r) for r in json.loads(p.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError, TypeError):
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return [CaseResult(backend, n, False, error=f"test process died (exit {p.returncode}): {tail}")
                for n in [c[0] for c in cases] + list(models)]


def self_test(device: str = "cuda", use_cache: bool = True, repeats: int = 5, heads: int = 24,
              head_dim: int = 128, cases=CASES, isolate: bool | None = None,
              models: tuple | None = None) -> AttentionReport:
    """Run forward+backward of every SDPA backend at the families' shapes; cached per fingerprint.

    Args:
        isolate: run each backend in a child process (default: on for CUDA).
        models: real-transformer cases to run too (default: all of them on CUDA, none on the CPU).
    """
    from lorakit.hardware.attention_model import MODEL_CASES

    models = (MODEL_CASES if device.startswith("cuda") else ()) if models is None else tuple(models)
    fp = fingerprint(device)
    fp.update(heads=heads, head_dim=head_dim, cases=[list(c) for c in cases], models=list(models), version=4)
    path = _cache_file(fp)
    if use_cache and path.is_file():
        try:
            return AttentionReport.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is simply re-measured
    isolate = device.startswith("cuda") if isolate is None else isolate
    run = _run_backend_isolated if isolate else _run_backend
    report = AttentionReport(fingerprint=fp)
    for backend in BACKENDS:
        report.results += run(backend, device, repeats, heads, head_dim, cases)
        # Each real-model case runs twice, each time first in a fresh process: a kernel that fails only
        # now and then (cuDNN inside FLUX on the H100 does) gets two chances to show it.
        for model_case in models:
            tries = [run(backend, device, 5, heads, head_dim, (), (model_case,))[0] for _ in range(2)]
            bad = [t for t in tries if not t.ok]
            report.results.append(bad[0] if bad else min(tries, key=lambda t: t.ms or 0.0))
    report.choice = {fam: choose(report, fam) for fam in FAMILY_CASES}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-run
    return report


# Backends lorakit will not train with on a stack, whatever one self-test run says, because they were
# seen failing there intermittently (a kernel that passes once can still corrupt memory later).
# Scoped to the families whose real transformer showed the failure (FLUX; Kandinsky 5 borrows its check).
KNOWN_BAD = (
    {"backend": "cudnn", "cudnn_prefix": "919", "capability": "9.0",
     "families": ("flux", "kandinsky5-t2i", "kandinsky5-t2v"),
     "reason": "cuDNN 9.19 attention backward on sm_90: non-finite gradients / illegal memory access inside "
               "the FLUX transformer in some runs (seen on an H100, 2026-11-22)"},
)


def known_bad(fingerprint_: dict, backend: str, family: str | None = None) -> str | None:
    """Why a backend is excluded on this stack for a family (any family when None); None when it is not."""
    for rule in KNOWN_BAD:
        if (rule["backend"] == backend and str(fingerprint_.get("cudnn") or "").startswith(rule["cudnn_prefix"])
                and fingerprint_.get("capability") == rule["capability"]
                and (family is None or family in rule["families"])):
            fams = ", ".join(rule["families"])
            return f"{rule['reason']} (for {fams})"
    return None


def choose(report: AttentionReport, family: str) -> str | None:
    """Fastest backend that passed every case relevant to a family and measured (None if none did)."""
    measured = {r.case for r in report.results}
    relevant = set(FAMILY_CASES.get(family, FAMILY_CASES["flux"])) & measured
    best, best_ms = None, None
    for backend in BACKENDS:
        rs = [r for r in report.results if r.backend == backend and r.case in relevant]
        if not relevant or len(rs) < len(relevant) or not all(r.ok for r in rs):
            continue
        if known_bad(report.fingerprint, backend, family):
            continue
        total = sum(r.ms or 0.0 for r in rs)
        if best_ms is None or total < best_ms:
            best, best_ms = backend, total
    if best == "efficient" and FAMILY_MASKED.get(family):
        # a batch whose prompts have one length carries no mask (train/data.drop_full_mask): flash can take it,
        # if flash passed the unmasked cases; the recompute sees the same inputs, so it picks the same kernel
        plain = [r for r in report.results if r.backend == "flash" and r.case in ("512px", "1024px")]
        if len(plain) == 2 and all(r.ok for r in plain) and not known_bad(report.fingerprint, "flash", family):
            return "flash+efficient"
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
    names = backend.split("+")  # "flash+efficient": flash where it can (no mask), efficient where not
    for n in names:
        if n not in BACKENDS:
            from lorakit.errors import UnknownNameError

            raise UnknownNameError("attention backend", n, list(BACKENDS))
    b.enable_flash_sdp("flash" in names)
    b.enable_mem_efficient_sdp("efficient" in names)
    b.enable_cudnn_sdp("cudnn" in names)
    b.enable_math_sdp("math" in names)
    return prev


def restore(prev: dict) -> None:
    """Undo `apply`."""
    import torch

    b = torch.backends.cuda
    b.enable_flash_sdp(prev["flash"])
    b.enable_mem_efficient_sdp(prev["efficient"])
    b.enable_cudnn_sdp(prev["cudnn"])
    b.enable_math_sdp(prev["math"])


if __name__ == "__main__":  # the child process of _run_backend_isolated
    import sys

    _a = json.loads(sys.argv[1])
    _res = _run_backend(_a["backend"], _a["device"], _a["repeats"], _a["heads"], _a["head_dim"],
                        [tuple(c) for c in _a["cases"]], tuple(_a.get("models", ())))
    print(json.dumps([asdict(r) for r in _res]))
