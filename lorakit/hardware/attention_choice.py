"""Choosing a family's attention backend from a self-test report: the fastest that passed every case the family
needs (at the run's resolution), never one a known-bad rule excludes; flash for unmasked batches of a masked family
where it passed the same shapes unmasked."""

from __future__ import annotations

from lorakit.hardware import fa4
from lorakit.hardware.attention_cases import (
    AttentionReport,
    all_cases,
    family_cases,
    family_masked,
    known_bad,
)
from lorakit.hardware.sdpa import ALL_BACKENDS, BACKENDS


def measured_backends(fingerprint_: dict) -> tuple[str, ...]:
    """The backends the self-test measures on this machine: PyTorch's four, and fa4 where flash-attn-4 is
    installed and could run (`fa4.candidate`)."""
    return ALL_BACKENDS if fa4.candidate(fingerprint_) else BACKENDS


def _unmasked_twin(case_name: str) -> str | None:
    """The bare case of the same shape without a mask (for flash on batches whose mask masks nothing)."""
    by_name = {c.name: c for c in all_cases()}
    c = by_name.get(case_name)
    if c is None or not c.masked:
        return None
    return next((o.name for o in by_name.values() if not o.masked and (o.seq, o.layout, o.head_dim, o.heads)
                 == (c.seq, c.layout, c.head_dim, c.heads)), None)


def _px(case: str) -> int | None:
    """The resolution a bare case stands for ("1024px single" -> 1024)."""
    head = case.split("px")[0]
    return int(head) if "px" in case and head.isdigit() else None


def _timed_cases(cases, resolution: int | None) -> set:
    """The bare cases whose times rank the backends: all of them, or, for a run at `resolution`, those of the
    nearest resolution measured (kernels rank differently at 512² and 1024²: FlashAttention 4 is faster than
    PyTorch's flash at 4608 tokens and slower at 1536 on an H100)."""
    bare = {c for c in cases if not c.startswith("model ")}
    sized = {c: _px(c) for c in bare if _px(c)}
    if resolution is None or not sized:
        return bare
    nearest = min(set(sized.values()), key=lambda px: (abs(px - resolution), -px))  # a tie: the larger
    return {c for c, px in sized.items() if px == nearest}


def choose(report: AttentionReport, family: str, resolution: int | None = None, exclude=()) -> str | None:
    """Fastest backend that passed every case relevant to a family and measured (None if none did); with
    `resolution`, fastest at the cases nearest that resolution (it must still pass them all); never one of
    `exclude` (alone or in a pair)."""
    measured = {r.case for r in report.results}
    relevant = set(family_cases(family)) & measured
    timed = _timed_cases(relevant, resolution)
    best, best_ms = None, None
    for backend in (b for b in ALL_BACKENDS if b not in exclude):
        rs = [r for r in report.results if r.backend == backend and r.case in relevant]
        if not relevant or {r.case for r in rs} != relevant or not all(r.ok for r in rs):
            continue
        if known_bad(report.fingerprint, backend, family):
            continue
        total = sum(r.ms or 0.0 for r in rs if r.case in timed)
        if best_ms is None or total < best_ms:
            best, best_ms = backend, total
    if best == "efficient" and family_masked(family):
        # a batch whose prompts have one length carries no mask (models/batch.drop_full_mask): a flash kernel
        # (PyTorch's, or FlashAttention 4) can take it, if it passed the same shapes unmasked — the faster of the
        # two that did; the recompute sees the same inputs, so it picks the same kernel
        twins = [t for t in (_unmasked_twin(c) for c in relevant) if t]
        timed_twins = {_unmasked_twin(c) for c in timed}
        fast, fast_ms = None, None
        for b in (b for b in ("flash", "fa4") if b not in exclude):
            plain = [r for r in report.results if r.backend == b and r.case in twins]
            if twins and len(plain) == len(twins) and all(r.ok for r in plain) \
                    and not known_bad(report.fingerprint, b, family):
                ms = sum(r.ms or 0.0 for r in plain if r.case in timed_twins)
                if fast_ms is None or ms < fast_ms:
                    fast, fast_ms = b, ms
        if fast:
            return f"{fast}+efficient"
    return best
