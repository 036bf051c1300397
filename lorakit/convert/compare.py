"""Do two LoRAs change the model the same way? Compared module by module through random probes."""

from __future__ import annotations


def deltas_equal(a, b, rtol: float = 1e-6, probes: int = 8, base: dict | None = None) -> tuple[bool, str]:
    """Do two LoRAs change every weight and bias the same way? Compared through random probes (delta @ x), so a
    full-size layer's delta never has to be materialised (DoRA needs `base`)."""
    import torch

    wa, wb = (getattr(x, "weights", x) for x in (a, b))
    ba, bb = (getattr(x, "biases", {}) for x in (a, b))
    if set(wa) != set(wb):
        return False, f"modules differ: {sorted(set(wa) ^ set(wb))[:3]}"
    if set(ba) != set(bb):
        return False, f"bias differences differ: {sorted(set(ba) ^ set(bb))[:3]}"
    g = torch.Generator().manual_seed(0)
    for m in wa:
        pa, pb = wa[m], wb[m]
        if tuple(pa.shape) != tuple(pb.shape):
            return False, f"{m}: shapes differ {tuple(pa.shape)} vs {tuple(pb.shape)}"
        W = base.get(m) if base else None
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
