"""Disk room for a full fine-tune's checkpoints, checked before anything loads: each checkpoint holds every weight
and the optimizer's moments (FLUX.1-dev: 71 GB), so a run that keeps several can fill a disk hours in. The peak
is the step checkpoints kept at once (`output.keep_last`, one more while the newest is written and before the
oldest is pruned), then the final checkpoint beside them (none more where the last step has its step checkpoint:
final/ is links to its files) and the exported model."""

from __future__ import annotations

from pathlib import Path

from lorakit.errors import EnvironmentFault, free_bytes
from lorakit.plan.memory import DTYPE_BYTES, moment_bytes, transformer_params


def optimizer_bytes(cfg) -> float:
    """Bytes per parameter of the optimizer state a full fine-tune's checkpoint holds: Adafactor's factored rows
    and columns are next to nothing, Prodigy keeps four tensors the weights' size, AdamW two moments."""
    if cfg.optim.name == "adafactor":
        return 0.0
    if cfg.optim.name == "prodigy":
        return 4.0 * DTYPE_BYTES[cfg.model.dtype]
    return float(moment_bytes(cfg))


def size(b: float) -> str:
    """Bytes as a person reads them on a disk ("309 GB", "1.4 GB", "84 MB")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.0f} {unit}" if b >= 10 * scale else f"{b / scale:.1f} {unit}"
    return f"{b:.0f} bytes"


def need(cfg, params: float, existing: int = 0) -> dict:
    """Bytes a full fine-tune's checkpoints and export add to its output folder at their peak; `existing`: step
    checkpoints already there (a resumed run)."""
    weights = params * DTYPE_BYTES[cfg.model.dtype]
    per = weights + params * optimizer_bytes(cfg)
    o = cfg.output
    written = cfg.schedule.steps // o.save_every if o.save_every else 0  # step checkpoints this run writes
    during = min(existing + written, o.keep_last + 1) if written else existing  # the newest before the prune
    kept = min(existing + written, o.keep_last) if written else existing  # beside the final one
    final = 0 if written and cfg.schedule.steps % o.save_every == 0 else 1  # else links to the last step's files
    peak = max(during * per, (kept + final) * per + weights)
    return {"checkpoint": per, "at_once": max(during, kept + final), "export": weights,
            "total": max(0.0, peak - existing * per)}


def check(cfg, out_dir: Path) -> dict | None:
    """Refuse a full fine-tune whose checkpoints cannot fit on the disk of `out_dir` (None for a LoRA run).

    Raises:
        EnvironmentFault: the disk has less room than the run's checkpoints and export need at their peak.
    """
    if cfg.method != "full":
        return None
    ck = Path(out_dir) / "checkpoints"
    existing = sum(1 for p in ck.glob("step-*") if p.is_dir()) if ck.is_dir() else 0
    params = transformer_params(cfg)
    n = need(cfg, params, existing)
    free = free_bytes(out_dir)
    n["free"] = free
    if free is None or n["total"] <= free:
        return n
    fixes = []
    for label, keep, every in (("output.keep_last=1", 1, cfg.output.save_every), ("output.save_every=0", 1, 0)):
        alt = cfg.model_copy(update={"output": cfg.output.model_copy(update={"keep_last": keep, "save_every": every})})
        t = need(alt, params, existing)["total"]
        if t < n["total"]:
            fixes.append(f"{label} ({size(t)}{', fits' if t <= free else ''})")
    raise EnvironmentFault(
        f"{out_dir}: this full fine-tune's checkpoints need about {size(n['total'])} on that disk at their peak "
        f"({n['at_once']} of {size(n['checkpoint'])} at once — weights and optimizer moments — and the exported "
        f"model, {size(n['export'])}); it has {size(free)} free",
        "; ".join(fixes + ["or output.dir on a disk with room"]))


def said(n: dict, out_dir: Path) -> str:
    """What a full fine-tune's checkpoints take on its output folder's disk, in one line (`--dry-run`)."""
    free = f"{size(n['free'])} free there" if n.get("free") is not None else "its free space could not be read"
    return (f"disk: this full fine-tune's checkpoints and export take about {size(n['total'])} in {out_dir} at "
            f"their peak ({n['at_once']} of {size(n['checkpoint'])} at once and the exported model); {free}")
