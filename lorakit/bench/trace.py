"""Where a bench step's time goes: a few more steps under the profiler, the busiest kernels, the GPU's idle gaps
between them (a host-bound step shows many gaps, a sync one big one), and the host's time against the GPU's in each
region the host ran at the top (a compiled block's call, the backward's compiled functions, the optimizer's step)."""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from pathlib import Path


def trace(step, spec: dict, cuda: bool, steps: int = 2) -> str:
    """Profile a few more steps; write the busiest kernels and the GPU's idle share to TRACE_DIR/<way>.txt."""

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key, 0) for e in ev if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")) / 1e6 if cuda else None
    lines = [f"{spec['way']} {spec['family']} {spec['res']}: {steps} steps, wall {wall:.3f} s"
             + (f", kernels busy {busy:.3f} s ({busy / wall:.0%} of wall)" if busy else "")]
    events = prof.events()
    if cuda:
        lines += gap_report(events)
    lines += region_report(events, steps)
    lines.append(ev.table(sort_by=key, row_limit=30, max_name_column_width=70))
    rank = f"-{spec.get('gpus', 1)}gpu-rank{os.environ.get('RANK', '0') or 0}" if spec.get("gpus", 1) > 1 else ""
    out = Path(spec["trace_dir"]) / f"{spec['way']}-{spec['family']}-{spec['res']}{rank}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    if cuda:  # the whole timeline, for chrome://tracing or Perfetto
        prof.export_chrome_trace(str(out.with_suffix(".json")))
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def gap_report(events, top: int = 12) -> list[str]:
    """Where the GPU waited: kernels merged into busy spans, the idle gaps between them (total, by size) and the
    largest ones with the kernels on either side — host-bound steps show up as many gaps, a sync as one big one."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not ks:
        return ["no kernels recorded"]
    gaps, end, prev = [], ks[0][1], ks[0][2]
    for s, e, name in ks[1:]:
        if s > end:
            gaps.append((s - end, prev, name))
        if e >= end:
            end, prev = e, name
    span = (end - ks[0][0]) / 1e6
    idle = sum(g for g, _, _ in gaps) / 1e6
    sizes = [(lo, hi, [g for g, _, _ in gaps if lo <= g < hi]) for lo, hi in
             ((0, 10), (10, 100), (100, 1000), (1000, float("inf")))]
    out = [f"GPU timeline {span:.3f} s from first to last kernel: idle {idle * 1e3:.1f} ms ({idle / span:.1%}) in "
           f"{len(gaps)} gaps; " + ", ".join(f"{len(g)} of {lo}-{hi if hi != float('inf') else ''} us: "
                                              f"{sum(g) / 1e3:.1f} ms" for lo, hi, g in sizes)]
    out += [f"  gap {g / 1e3:8.3f} ms after {a[:60]!r} before {b[:60]!r}" for g, a, b in sorted(gaps, reverse=True)[:top]]
    return out


def region_report(events, steps: int, top: int = 8) -> list[str]:
    """Host time against GPU time per step, by what each host thread ran outermost (its operators with no parent:
    the forward's compiled blocks on the main thread, the backward's compiled functions on autograd's), grouped by
    name with numbers folded: where a region's host time exceeds its kernels' time, the GPU waited for the host
    there. Times are under the profiler, whose own cost inflates the host's side."""
    rows: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0, 0]))  # thread -> name -> host, gpu, calls, k
    for e in events:
        if not str(getattr(e, "device_type", "")).endswith("CPU") or e.cpu_parent is not None or e.is_async:
            continue
        r = rows[e.thread][re.sub(r"\d+", "#", e.name)[:70]]
        r[0] += e.cpu_time_total
        r[1] += e.device_time_total
        r[2] += 1
        r[3] += _kernels(e)
    out = [f"host against GPU by region, per step (ms; under the profiler): {len(rows)} threads"]
    for thread, names in sorted(rows.items(), key=lambda t: -sum(r[0] for r in t[1].values())):
        host, gpu = (sum(r[i] for r in names.values()) / steps / 1e3 for i in (0, 1))
        out.append(f"  thread {thread}: host {host:.1f}, GPU {gpu:.1f}")
        for name, (h, g, n, k) in sorted(names.items(), key=lambda x: -x[1][0])[:top]:
            out.append(f"    host {h / steps / 1e3:8.1f}  GPU {g / steps / 1e3:8.1f}  {n / steps:6.0f} calls "
                       f"{k / steps:7.0f} kernels  {name}")
    return out


def _kernels(e) -> int:
    """Kernels an operator launched, its children's included."""
    return len(getattr(e, "kernels", ())) + sum(_kernels(c) for c in e.cpu_children)
