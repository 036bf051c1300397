"""`lorakit bench load`: weight-loading backends side by side, measured in one run.

For each backend x page cache (warm, cold) x target (cpu, cuda): seconds, GB/s, peak GPU memory above
the start, peak host RSS growth, and a bit-exact check against a plain safetensors read. CPU figures
count tensors materialised in memory (every 4 KiB page touched inside the timing), not lazy maps.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lorakit.bench.poll import Peak
from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.io import load, read_header, resolve_files, save_sharded
from lorakit.io.modules import load_component

WAYS = ("safetensors", "safetensors+to", "fastsafetensors", "lorakit", "lorakit-copy")


@dataclass
class Row:
    way: str
    cache: str
    target: str
    seconds: float | None
    gbps: float | None
    peak_gpu_gib: float | None
    rss_growth_gib: float | None
    exact: bool | None
    note: str = ""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise InputError(f"--synthetic: cannot read size {text!r}", "e.g. 256M, 8G")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def make_synthetic(folder: Path, size: int, shards: int = 2, tensors_per_shard: int = 64) -> list[Path]:
    """bf16 tensors of random bytes (never zeros), split like a real sharded checkpoint."""
    import torch

    n = max(shards * tensors_per_shard, 1)
    per = max(size // n // 2, 1)  # bf16 elements per tensor
    g = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.weight": torch.randint(0, 256, (per * 2,), dtype=torch.uint8, generator=g).view(
        torch.bfloat16) for i in range(n)}
    out = save_sharded(tensors, folder, base="model", max_shard_bytes=-(-per * 2 * n // shards))
    return [p for p in out if p.suffix == ".safetensors"]


def drop_cache(files: list[Path], machine_wide: bool = False) -> str:
    """Evict the files from the page cache (theirs alone: posix_fadvise), and with `machine_wide` every file's
    (drop_caches, where permitted: it slows everyone on a shared machine); say how (or that it could not)."""
    how = []
    if machine_wide:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            how.append("drop_caches")
        except OSError:
            pass
    else:
        for p in files:  # their dirty pages written first: DONTNEED leaves those in memory
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how.append("posix_fadvise(DONTNEED)")
    left = max(resident_fraction(p) for p in files)
    fs = filesystem_of(files[0])
    if fs in ("tmpfs", "ramfs") or left > 0.05:
        why = f"the files are on {fs} (memory)" if fs in ("tmpfs", "ramfs") else f"{left:.0%} still resident"
        return " + ".join(how) + f" (NOT effective: {why}, so 'cold' rows are warm; use --dir on a disk)"
    return " + ".join(how) + f" ({left:.1%} resident after the drop)"


def warm_cache(files: list[Path]) -> None:
    """Read every byte of the files once (a lazy map would leave them uncached) so they sit in the page cache."""
    buf = bytearray(64 * 2**20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore on a read-only map)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0:
        return 0.0
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, never written: file pages
    try:
        buf = (ctypes.c_char * 1).from_buffer(m)
        addr = ctypes.addressof(buf)
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            return 0.0
        del buf
        return sum(v & 1 for v in vec) / n
    finally:
        m.close()


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding a path (from /proc/mounts; "?" when unknown)."""
    best, kind = "", "?"
    try:
        real = str(Path(path).resolve())
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _touch(tensors: dict) -> None:
    import torch

    for t in tensors.values():
        if t.device.type == "cpu" and t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def _load(way: str, files: list[Path], target: str) -> dict:
    import torch

    if way == "safetensors":
        return load(files, device=target, backend="safetensors")
    if way == "safetensors+to":
        return {k: v.to(target) for k, v in load(files, backend="safetensors").items()}
    if way == "fastsafetensors":
        return load(files, device=target, backend="fastsafetensors")
    out = load(files, device=target, backend="lorakit", copy=way == "lorakit-copy")
    if target != "cpu":
        torch.cuda.synchronize()
    return out


def run(files: list[Path], targets=("cpu",), ways=WAYS, caches=("warm", "cold"), repeats: int = 3, drop_caches: bool = False,
        progress=None) -> tuple[list[Row], dict]:
    """Measure every way; returns rows and notes (cache method, sizes)."""
    import torch

    size = sum(p.stat().st_size for p in files)
    ref = {}
    from safetensors.torch import load_file

    for p in files:  # private copies: a reference that maps the files would pin their pages in the cache
        ref.update({k: v.clone() for k, v in load_file(p).items()})
    notes = {"bytes": size, "files": [str(p) for p in files]}
    rows: list[Row] = []
    for target in targets:
        for way in ways:
            if (way == "safetensors+to" and target == "cpu") or (way == "lorakit-copy" and target != "cpu"):
                continue
            for cache in caches:
                if progress:
                    progress(f"{way} {cache} -> {target}")
                times, gpu_peak, rss, exact, note = [], None, None, None, ""
                for _ in range(repeats):
                    if cache == "cold":
                        notes["cold_method"] = drop_cache(files, machine_wide=drop_caches)
                    else:
                        warm_cache(files)
                    if target != "cpu":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    try:
                        with Peak(_rss, 0.005) as r:
                            t0 = time.perf_counter()
                            out = _load(way, files, target)
                            _touch(out)
                            times.append(time.perf_counter() - t0)
                    except Exception as e:  # noqa: BLE001 - a failing way is a row
                        note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                        break
                    rss = max(rss or 0, r.peak - r.start)
                    if target != "cpu":
                        gpu_peak = max(gpu_peak or 0, torch.cuda.max_memory_allocated() - base)
                    if exact is None:
                        exact = all(torch.equal(out[k].cpu().reshape(-1).view(torch.uint8),
                                                ref[k].reshape(-1).view(torch.uint8)) for k in ref)
                    del out
                s = statistics.median(times) if times else None
                rows.append(Row(way, cache, target, round(s, 4) if s else None,
                                round(size / s / 1e9, 2) if s else None,
                                round(gpu_peak / 2**30, 2) if gpu_peak is not None else None,
                                round(rss / 2**30, 2) if rss is not None else None, exact, note))
    return rows, notes


def bench(path: Path | None, synthetic: str | None, targets, repeats: int, keep: bool, progress=None,
          where: Path | None = None, caches=("warm", "cold"), drop_caches: bool = False) -> dict:
    """The command's library function (`where`: the folder for synthetic files)."""
    tmp = None
    if synthetic:
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="lorakit-bench-", dir=where))
        files = make_synthetic(tmp, parse_size(synthetic))
    elif path is not None:
        files = resolve_files(path)
        for f in files:  # lorakit's validation first: no third-party reader sees a damaged file
            read_header(f)
    else:
        raise InputError("bench load needs a PATH or --synthetic SIZE", "e.g. lorakit bench load --synthetic 1G")
    try:
        rows, notes = run(files, targets=targets, repeats=repeats, progress=progress, caches=caches,
                           drop_caches=drop_caches)
    finally:
        if tmp is not None and not keep:
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    return {"rows": [asdict(r) for r in rows], "filesystem": filesystem_of(files[0]), **notes}


def bench_model_dir(folder: Path, device: str, dtype_name: str = "bf16", repeats: int = 3) -> dict:
    """Time to "components ready on the device" for a whole pipeline folder: lorakit's way (every weight
    component built on meta and filled by lorakit.io, as train does) beside diffusers' from_pretrained."""
    import json as _json

    import torch

    dtype = torch_dtype(dtype_name)
    folder = Path(folder)
    index = _json.loads((folder / "model_index.json").read_text())
    comps = [k for k, v in index.items() if isinstance(v, list) and v[0] and (folder / k / "config.json").is_file()
             and any((folder / k).glob("*.safetensors*"))]
    if not comps:
        raise InputError(f"{folder}: no weight components found", "point --model-dir at a diffusers pipeline folder")

    def ours():
        return {c: load_component(folder / c, device, dtype) for c in comps}

    def stock():
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype)
        return {c: getattr(pipe, c).to(device) for c in comps}

    rows = []
    for way, fn in (("diffusers from_pretrained", stock), ("lorakit", ours)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = fn()
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del got
        rows.append({"way": way, "seconds": round(statistics.median(times), 4)})
    return {"model_dir": str(folder), "components": comps, "device": device, "dtype": dtype_name, "rows": rows}
