"""Do two LoRAs change the model the same way? Compared module by module through random probes."""

from __future__ import annotations

from contextlib import contextmanager

from lorakit.convert.patches import LowRank


def low_rank(weights) -> bool:
    """Is comparing these patches only small products (LoRA without DoRA), none of a full-size layer's size?"""
    return all(isinstance(p, LowRank) and not p.dora for p in weights)


@contextmanager
def one_thread(small: bool = True):
    """Torch's CPU operations on the calling thread alone while inside, where the work is `small`. A low-rank
    comparison is thousands of small products (rank x width x 8 probes): split over every core, each waits for
    all of that many threads, and on a busy host (other trainings, compile workers) a thread not scheduled
    stalls every product: the final checkpoint's read-back took 56-69 s with four trainings on one 64-core host,
    1.3-2.6 s on one thread (4x H200 host, 2026-11-26; FLUX.2 [dev]'s 160 modules on the idle host: 1.1 s on one
    thread, 2.7 s on 64). Work on full-size layers (DoRA's norms, LoKr/LoHa's dense change) keeps every thread."""
    import torch

    n = torch.get_num_threads()
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def deltas_equal(a, b, rtol: float = 1e-6, probes: int = 8, base: dict | None = None) -> tuple[bool, str]:
    """Do two LoRAs change every weight and bias the same way? Compared through random probes (delta @ x), so a
    full-size layer's delta never has to be materialised (DoRA needs `base`)."""
    wa, wb = (getattr(x, "weights", x) for x in (a, b))
    ba, bb = (getattr(x, "biases", {}) for x in (a, b))
    if set(wa) != set(wb):
        return False, f"modules differ: {sorted(set(wa) ^ set(wb))[:3]}"
    if set(ba) != set(bb):
        return False, f"bias differences differ: {sorted(set(ba) ^ set(bb))[:3]}"
    with one_thread(low_rank(wa.values()) and low_rank(wb.values())):
        return _compare(wa, wb, ba, bb, rtol, probes, base)


def _compare(wa, wb, ba, bb, rtol, probes, base) -> tuple[bool, str]:
    import torch

    g = torch.Generator().manual_seed(0)
    for m in wa:
        pa, pb = wa[m], wb[m]
        if tuple(pa.shape) != tuple(pb.shape):
            return False, f"{m}: shapes differ {tuple(pa.shape)} vs {tuple(pb.shape)}"
        W = base.get(m) if base else None
        if W is None and _same_dora_form(pa, pb):  # the same low-rank change and the same DoRA vector: equal on
            pa, pb = _without_dora(pa), _without_dora(pb)  # any base (the vectors were compared just now)
        elif W is None and isinstance(pa, LowRank) and pa.dora and _dora_vectors_differ(pa, pb):
            return False, f"{m}: DoRA vectors differ"
        x = torch.randn(pa.shape[-1], probes, generator=g, dtype=torch.float64) if len(pa.shape) == 2 else None
        ya, yb = (pa.probe(x, W), pb.probe(x, W)) if x is not None else (pa.delta(), pb.delta())
        err = float((ya - yb).norm() / ya.norm().clamp(min=1e-30))
        if err > rtol:
            return False, f"{m}: relative difference {err:.2e}"
    for m in ba:
        err = float((ba[m].double() - bb[m].double()).norm() / ba[m].double().norm().clamp(min=1e-30))
        if err > rtol:
            return False, f"{m} bias: relative difference {err:.2e}"
    return True, "equal"


def _form(p) -> tuple[str, object]:
    """How a DoRA patch stores its vector — ("magnitude", v) for peft's, ("out" | "in", v) for ComfyUI's
    `dora_scale` on the output or input axis (ComfyUI's rule: output when its first size is the weight's rows)."""
    if p.magnitude is not None:
        return "magnitude", p.magnitude
    return ("out" if p.dora_scale.shape[0] == p.B.shape[0] else "in"), p.dora_scale


def _same_dora_form(pa, pb) -> bool:
    """Two DoRA patches stored alike with the same vector: they differ at most in their low-rank change, which
    needs no base to compare."""
    import torch

    if not (isinstance(pa, LowRank) and isinstance(pb, LowRank) and pa.dora and pb.dora):
        return False
    (ka, va), (kb, vb) = _form(pa), _form(pb)
    return ka == kb and va.numel() == vb.numel() and torch.allclose(va.double().reshape(-1), vb.double().reshape(-1),
                                                                    rtol=1e-6, atol=0)


def _dora_vectors_differ(pa, pb) -> bool:
    """Both stored alike, but with other vectors (with no base, nothing else could be compared)."""
    return isinstance(pb, LowRank) and pb.dora and _form(pa)[0] == _form(pb)[0]


def _without_dora(p) -> LowRank:
    return LowRank(p.A, p.B, p.alpha)
