"""What the dashboard shows of the machine beside the jobs: each GPU's memory, utilization, temperature and power
(`nvidia-smi`, asked without importing torch), the host's load, memory and the runs folder's free disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

QUERY = ("index", "name", "memory.used", "memory.total", "utilization.gpu", "temperature.gpu", "power.draw")
TIMEOUT_S = 5
KEEP_S = 1.0  # answers within this long reuse the last reading (several open pages poll at once)

_last: dict = {"at": 0.0, "gpus": None}


def _number(v: str):
    """nvidia-smi's value as a number; None for "[N/A]", "[Not Supported]" and the like."""
    try:
        return float(v)
    except ValueError:
        return None


def gpus() -> dict:
    """{"gpus": [{index, name, memory_used_mib, memory_total_mib, utilization_pct, temperature_c, power_w}], "note"}:
    the note says why the list is empty (no nvidia-smi, or what it answered)."""
    now = time.monotonic()
    if _last["gpus"] is not None and now - _last["at"] < KEEP_S:
        return _last["gpus"]
    exe = shutil.which("nvidia-smi")
    if not exe:
        got = {"gpus": [], "note": "no NVIDIA GPU here (nvidia-smi not found)"}
    else:
        try:
            p = subprocess.run([exe, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=TIMEOUT_S)
            got = _parse(p.stdout) if p.returncode == 0 else \
                {"gpus": [], "note": f"nvidia-smi failed: {(p.stderr or p.stdout).strip()[:200]}"}
        except (OSError, subprocess.SubprocessError) as e:
            got = {"gpus": [], "note": f"nvidia-smi did not answer: {type(e).__name__}"}
    _last.update(at=now, gpus=got)
    return got


def _parse(out: str) -> dict:
    rows = []
    for line in out.strip().splitlines():
        v = [x.strip() for x in line.split(",")]
        if len(v) != len(QUERY):
            continue
        rows.append({"index": int(_number(v[0]) or 0), "name": v[1], "memory_used_mib": _number(v[2]),
                     "memory_total_mib": _number(v[3]), "utilization_pct": _number(v[4]),
                     "temperature_c": _number(v[5]), "power_w": _number(v[6])})
    return {"gpus": rows, "note": None if rows else f"nvidia-smi listed no GPU ({out.strip()[:200]!r})"}


def host(folder: Path) -> dict:
    """The host's load average, memory (MemTotal / MemAvailable) and the free disk where `folder` is."""
    out: dict = {"cpus": os.cpu_count()}
    try:
        out["load_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        out["load_1m"] = None
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total, avail = (int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
        out.update(memory_total_gib=round(total / 2**30, 1), memory_available_gib=round(avail / 2**30, 1))
    except (OSError, KeyError, ValueError):
        out.update(memory_total_gib=None, memory_available_gib=None)
    try:
        du = shutil.disk_usage(folder)
        out.update(disk_free_gib=round(du.free / 2**30, 1), disk_total_gib=round(du.total / 2**30, 1))
    except OSError:
        out.update(disk_free_gib=None, disk_total_gib=None)
    return out


def machine(folder: Path) -> dict:
    return {**gpus(), "host": host(folder)}
