"""What the attention self-test measures: the cases each family needs a backend to pass (the adapters' bare SDPA
shapes, and "model <arch>": the architecture's real blocks), the machine fingerprint a result is kept under, the
known-bad rules, and one bare case run in this process (`run_case`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from lorakit.hardware import fa4
from lorakit.hardware.probe import probe
from lorakit.hardware.sdpa import sdp_backend
from lorakit.models.base import family_adapter
from lorakit.models.facts import AttentionCase
from lorakit.models.registry import arch_names, family_names


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
    seconds: float | None = None

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "results": [asdict(r) for r in self.results],
                "choice": self.choice, "cached": self.cached, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> AttentionReport:
        return cls(fingerprint=d["fingerprint"], results=[CaseResult(**r) for r in d["results"]],
                   choice=d["choice"], cached=True, seconds=d.get("seconds"))


def model_case(family: str) -> str:
    """The in-model case of a family: its architecture's real transformer blocks."""
    return f"model {family_adapter(family).arch}"


def family_cases(family: str) -> tuple[str, ...]:
    """Every case a backend must pass before lorakit trains this family with it."""
    return tuple(c.name for c in family_adapter(family).attention_cases) + (model_case(family),)


def family_masked(family: str) -> bool:
    """Does the family pass a text mask into attention (flash refuses masks)?"""
    return any(c.masked for c in family_adapter(family).attention_cases)


def all_cases() -> tuple[AttentionCase, ...]:
    """The bare cases of every registered family, once each."""
    seen: dict[str, AttentionCase] = {}
    for f in family_names():
        for c in family_adapter(f).attention_cases:
            seen.setdefault(c.name, c)
    return tuple(seen.values())


def all_model_cases() -> tuple[str, ...]:
    return tuple(f"model {a}" for a in arch_names())


def known_bad(fingerprint_: dict, backend: str, family: str | None = None) -> str | None:
    """Why a backend is excluded on this stack for a family (any family when None); None when it is not.
    The rules are the families' own (`Adapter.known_bad_attention`): backends seen failing intermittently there
    (a kernel that passes once can still corrupt memory later)."""
    for fam in [family] if family else family_names():
        for b, cudnn, capability, why in family_adapter(fam).known_bad_attention:
            if (b == backend and str(fingerprint_.get("cudnn") or "").startswith(cudnn)
                    and fingerprint_.get("capability") == capability):
                return f"{why} (for {fam})" if family is None else why
    return None


def fingerprint(device: str = "cuda", facts=None) -> dict:
    """What the self-test result depends on: GPU, driver, torch, CUDA, cuDNN (from the probe's `facts`, so a
    cached doctor answers without importing torch; probed when None)."""
    if facts is None:  # a training run: the same answer doctor keyed its report by, probed once per machine
        facts = probe(use_cache=True)
    cudnn = facts.cudnn
    if cudnn and "." in cudnn:  # "9.19.0" -> 91900, as torch.backends.cudnn.version() says it
        a, b, c = (int(x) for x in (cudnn.split(".") + ["0", "0"])[:3])
        cudnn = a * 10000 + b * 100 + c
    elif cudnn:
        cudnn = int(cudnn)
    fp = {"torch": facts.torch, "cuda": facts.torch_cuda, "cudnn": cudnn, "device": device,
          "fa4": fa4.installed()}  # installing flash-attn-4 (or another release) means measuring again
    index = int(device.split(":")[1]) if ":" in device else 0
    if device.startswith("cuda") and len(facts.gpus) > index:
        g = facts.gpus[index]
        fp.update(gpu=g.name, capability=f"{g.capability[0]}.{g.capability[1]}", driver=facts.driver)
    else:
        import platform

        fp.update(gpu=None, cpu=platform.processor() or platform.machine())
    return fp


def run_case(backend: str, case: AttentionCase, device: str, repeats: int) -> CaseResult:
    """Forward + backward of one backend, with tensors laid out as the diffusers transformers lay them out.

    diffusers projects q/k/v to (batch, seq, heads, head_dim) and permutes them to (batch, heads, seq,
    head_dim) for SDPA, then permutes the output back and flattens the heads: the kernels see strided
    inputs and a strided output gradient. Contiguous tensors would pass where the real model fails.
    """
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    seq, heads, hd, dtype = case.seq, case.heads, case.head_dim, torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(1, seq, heads, hd, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(3)]
    width = heads * hd * (5 if case.layout == "single" else 1)  # single: attention (1x) + MLP (4x)
    weight = torch.randn(1, seq, width, device=device, dtype=torch.float32, generator=g)
    mlp = torch.randn(1, seq, width - heads * hd, device=device, dtype=dtype, generator=g)
    mask = None
    if case.masked:  # the last 10% of keys are padding, as with padded text
        keep = torch.ones(seq, dtype=torch.bool, device=device)
        keep[int(seq * 0.9):] = False
        mask = keep[None, None, None, :]
    times = []
    try:
        if backend == "fa4":
            fa4.activate()  # SDPA's flash path now runs FlashAttention 4
        with sdpa_kernel([sdp_backend("flash" if backend == "fa4" else backend)]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "kernel not used because ..." is what we record
            for i in range(repeats + 1):
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                q, k, v = (t.permute(0, 2, 1, 3) for t in base)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out = out.permute(0, 2, 1, 3).reshape(1, seq, heads * hd)
                if case.layout == "single":
                    out = torch.cat([out, mlp], dim=2)
                (out.float() * weight).mean().backward()
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                if i:  # the first run is warm-up
                    times.append((time.perf_counter() - t0) * 1e3)
                if not all(torch.isfinite(t.grad).all() for t in base):
                    return CaseResult(backend, case.name, False, error="non-finite gradients")
                for t in base:
                    t.grad = None
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        return CaseResult(backend, case.name, False, error=error_line(e))
    finally:
        fa4.deactivate()
    times.sort()
    return CaseResult(backend, case.name, True, ms=round(times[len(times) // 2], 3))


def error_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:300]}"


def context_lost(r: CaseResult) -> bool:
    return not r.ok and any(s in (r.error or "") for s in ("CUDA error", "AcceleratorError", "CUBLAS_STATUS"))
