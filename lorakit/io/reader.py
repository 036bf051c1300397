"""One entry point for reading safetensors: a file, a list, or a (sharded) folder -> tensors.

Backends:
- `lorakit`: every header validated first (`header.py`); to the CPU, tensors over a private
  copy-on-write map of the file (no copy; with `copy=True`, many threads `pread` each tensor straight
  into its own storage); to a GPU, threads `pread` chunks into pairs of
  pinned buffers and copy them to the GPU asynchronously on per-thread streams, so disk/page-cache reads
  and host-to-device copies overlap. Peak GPU memory is the checkpoint itself.
- `safetensors`: `safetensors.torch.load_file`.
- `fastsafetensors`: `fastsafe_open` (nogds; GDS where `gds=True` and available). Its tensors share one
  buffer per file (freed when the last tensor of that file dies).
- `auto`: `lorakit`, except where another fits better (each fallback is logged with its reason).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lorakit.errors import FileFormatError, InputError, UnknownNameError
from lorakit.io.header import Header, read_header

log = logging.getLogger("lorakit.io")

BACKENDS = ("auto", "lorakit", "safetensors", "fastsafetensors")
CHUNK = 32 * 2**20  # bytes per read (CPU path)
GPU_CHUNK = 16 * 2**20  # bytes per pinned staging buffer (two per thread: 16 threads hold 512 MiB pinned)


def gpu_tuning() -> tuple[int, int]:
    """(threads, chunk bytes) of the GPU path; LORAKIT_IO_THREADS / LORAKIT_IO_CHUNK_MIB override them."""
    threads = int(os.environ.get("LORAKIT_IO_THREADS") or min(16, max(4, os.cpu_count() or 4)))
    chunk = int(float(os.environ.get("LORAKIT_IO_CHUNK_MIB") or GPU_CHUNK / 2**20) * 2**20)
    return max(threads, 1), max(chunk, 2**20)


def resolve_files(source) -> list[Path]:
    """A file, a list of files, or a folder (sharded via `*.safetensors.index.json`) -> shard paths."""
    if isinstance(source, (list, tuple)):
        out: list[Path] = []
        for s in source:
            out += resolve_files(s)
        return out
    p = Path(source)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _from_index(p)
        return [p]
    if not p.exists():
        raise InputError(f"no such file or folder: {p}")
    if not p.is_dir():
        read_header(p)  # names what it is (a FIFO, a device) without opening it
    if (p / "model_index.json").is_file():
        comps = sorted(d.name for d in p.iterdir() if d.is_dir() and any(d.glob("*.safetensors")))
        raise InputError(f"{p} is a whole pipeline folder; name one component",
                         f"e.g. {p / comps[0]}" if comps else None)
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise InputError(f"{p} holds several shard indexes: {', '.join(i.name for i in indexes)}",
                         "name the index file you mean")
    if indexes:
        return _from_index(indexes[0])
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise InputError(f"no .safetensors files in {p}")
    return files


def _from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        weight_map = None
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise FileFormatError(f"{index}: not a valid shard index (no weight_map of file names)")
    names = list(dict.fromkeys(weight_map.values()))
    if any(Path(n).name != n for n in names):
        raise FileFormatError(f"{index}: shard names must be files beside the index, got {names[0]!r}"[:300])
    files = [index.parent / n for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileFormatError(f"{index}: shards missing: {', '.join(missing)}", "the download is incomplete")
    return files


def load(source, device: str = "cpu", dtype=None, backend: str = "auto", keys=None, threads: int | None = None,
         unified_memory: bool = False, copy: bool = False) -> dict:
    """Read tensors.

    Args:
        source: file, list of files, or folder.
        device: "cpu" or "cuda[:N]".
        dtype: cast floating-point tensors to this torch dtype (None: as stored).
        backend: one of BACKENDS.
        keys: only these tensor names (None: all).
        threads: reader threads (default: `gpu_tuning()` for the GPU path, min(8, cores) for the CPU).
        unified_memory: the GPU shares memory with the CPU (DGX Spark): no pinned staging.
        copy: to the CPU, read into private memory instead of mapping the file (copy-on-write); use it
            when the file may be rewritten in place while the tensors live.

    Returns:
        name -> tensor on `device`.
    """
    if backend not in BACKENDS:
        raise UnknownNameError("loader backend", backend, list(BACKENDS))
    files = resolve_files(source)
    headers = [read_header(f) for f in files]  # validate everything before reading anything
    wanted = _select(headers, keys)
    chosen = _choose(backend, device, unified_memory)
    if chosen == "safetensors":
        out = _load_safetensors(headers, wanted, device)
    elif chosen == "fastsafetensors":
        out = _load_fastsafetensors(headers, wanted, device)
    elif device == "cpu" and not copy:
        out = _load_mapped(headers, wanted)
    elif device == "cpu":
        out = _load_cpu(headers, wanted, threads)
    elif unified_memory:
        out = _load_unified(headers, wanted, device, threads)
    else:
        t, chunk = gpu_tuning()
        out = _load_gpu(headers, wanted, device, threads or t, chunk)
    if dtype is not None:  # one tensor at a time: never the checkpoint twice
        for k in list(out):
            if out[k].is_floating_point() and out[k].dtype != dtype:
                out[k] = out[k].to(dtype)
    return out


def _select(headers: list[Header], keys) -> dict[str, list[str]]:
    """path -> names to read (duplicates across shards and unknown keys are errors)."""
    owner: dict[str, str] = {}
    for h in headers:
        for name in h.tensors:
            if name in owner:
                raise FileFormatError(f"tensor {name!r} is in both {owner[name]} and {h.path}")
            owner[name] = h.path
    if keys is not None:
        keys = list(keys)
        unknown = [k for k in keys if k not in owner]
        if unknown:
            raise InputError(f"tensors not in the files: {', '.join(unknown[:5])}"
                             + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    sel: dict[str, list[str]] = {h.path: [] for h in headers}
    for name in (keys if keys is not None else owner):
        sel[owner[name]].append(name)
    return sel


def _choose(backend: str, device: str, unified: bool) -> str:
    if backend != "auto":
        if backend == "fastsafetensors" and not _fastsafetensors_ok():
            raise InputError("loader backend fastsafetensors is not installed", "pip install fastsafetensors")
        return backend
    if device != "cpu" and not unified:
        import torch

        if not torch.cuda.is_available():
            log.info("loader: no CUDA runtime, falling back from the GPU path to safetensors")
            return "safetensors"
    return "lorakit"


def _fastsafetensors_ok() -> bool:
    import importlib.util

    return importlib.util.find_spec("fastsafetensors") is not None


# --------------------------------------------------------------------------- backends


def _load_safetensors(headers, wanted, device) -> dict:
    from safetensors import safe_open

    out = {}
    for h in headers:
        with safe_open(h.path, framework="pt", device=device if device != "cpu" else "cpu") as f:
            for name in wanted[h.path]:
                out[name] = f.get_tensor(name)
    return out


def _load_fastsafetensors(headers, wanted, device) -> dict:
    from fastsafetensors import fastsafe_open

    files = [h.path for h in headers if wanted[h.path]]
    out = {}
    if not files:
        return out
    if device.startswith("cuda") and ":" not in device:  # fastsafetensors wants an index
        import torch

        device = f"cuda:{torch.cuda.current_device()}"
    with fastsafe_open(files, framework="pt", device=device, nogds=True) as f:
        for names in wanted.values():
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def _read_into(fd: int, mv: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise FileFormatError(f"{path}: file ended while reading (truncated during the read?)")
        done += n


def _typed(buf, info):
    import torch

    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype, device=buf.device)
    return buf.view(info.torch_dtype).reshape(info.shape)


def _load_mapped(headers, wanted) -> dict:
    """Tensors over a private (copy-on-write) map of each validated file: no copy, pages come from the
    page cache on first touch; writing to a tensor never changes the file."""
    import mmap

    import torch

    out = {}
    for h in headers:
        names = wanted[h.path]
        if not names:
            continue
        if h.data_size == 0:
            out.update({n: _typed(torch.empty(0, dtype=torch.uint8), h.tensors[n]) for n in names})
            continue
        with open(h.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        for name in names:
            info = h.tensors[name]
            if info.nbytes == 0:
                out[name] = _typed(torch.empty(0, dtype=torch.uint8), info)
                continue
            buf = torch.frombuffer(m, dtype=torch.uint8, count=info.nbytes, offset=h.data_start + info.begin)
            out[name] = _typed(buf, info)  # each tensor keeps the map alive
    return out


def _load_cpu(headers, wanted, threads) -> dict:
    """Each tensor gets its own storage; threads pread straight into it (large tensors in chunks)."""
    import torch

    jobs = []
    bufs = {}
    for h in headers:
        for name in wanted[h.path]:
            info = h.tensors[name]
            buf = torch.empty(info.nbytes, dtype=torch.uint8)
            bufs[name] = (buf, info)
            mv = memoryview(buf.numpy()) if info.nbytes else None
            for a in range(0, info.nbytes, CHUNK):
                b = min(a + CHUNK, info.nbytes)
                jobs.append((h, mv, a, b, h.data_start + info.begin + a))
    fds = {h.path: os.open(h.path, os.O_RDONLY) for h in headers if wanted[h.path]}
    try:
        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as ex:
            for f in [ex.submit(_read_into, fds[h.path], mv[a:b], off, h.path) for h, mv, a, b, off in jobs]:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return {name: _typed(buf, info) for name, (buf, info) in bufs.items()}


UNIFIED_BATCH = 2 << 30  # bytes read into host memory at a time before they move to the GPU (unified memory)


def _load_unified(headers, wanted, device, threads, batch: int = UNIFIED_BATCH) -> dict:
    """Unified memory (DGX Spark): the GPU's tensors take the same memory as the host's, so the whole checkpoint
    read to the host before moving would be held twice at once (a 38 GiB transformer: 77 GiB of the Spark's 128
    GB). Tensors are read about `batch` bytes at a time (and a larger tensor alone), each batch moved before the
    next is read."""
    out = {}
    for h in headers:
        names, size = [], 0
        for name in [*wanted[h.path], None]:
            if name is not None:
                names.append(name)
                size += h.tensors[name].nbytes
            if names and (name is None or size >= batch):
                part = _load_cpu([h], {h.path: names}, threads)
                for k in names:
                    out[k] = part.pop(k).to(device)
                names, size = [], 0
    return out


class _Staging:
    """Per-thread pinned double buffers and a CUDA stream, kept between loads."""

    _pool: dict = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, device, slot: int, chunk: int):
        import torch

        key = (str(device), slot, chunk)
        with cls._lock:
            if key not in cls._pool:
                bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                cls._pool[key] = (bufs, torch.cuda.Stream(device=device), [None, None])
            return cls._pool[key]


def _load_gpu(headers, wanted, device, threads, chunk) -> dict:
    """pread into pinned double buffers, async host-to-device copies on per-thread streams."""
    import torch

    dev = torch.device(device)
    bufs, work = {}, []
    for h in headers:
        for name in wanted[h.path]:
            info = h.tensors[name]
            buf = torch.empty(info.nbytes, dtype=torch.uint8, device=dev)
            bufs[name] = (buf, info)
            for a in range(0, info.nbytes, chunk):
                work.append((h, buf, a, min(a + chunk, info.nbytes), h.data_start + info.begin + a))
    work.sort(key=lambda w: (w[0].path, w[4]))  # sequential within a file: friendlier to the disk
    fds = {h.path: os.open(h.path, os.O_RDONLY) for h in headers if wanted[h.path]}
    errors: list[BaseException] = []

    def worker(slot: int) -> None:
        staging, stream, events = _Staging.get(dev, slot, chunk)
        try:
            for i, (h, dst, a, b, off) in enumerate(work[slot::threads]):
                k = i % 2
                if events[k] is not None:
                    events[k].synchronize()  # the previous copy out of this buffer is done
                n = b - a
                _read_into(fds[h.path], memoryview(staging[k].numpy())[:n], off, h.path)
                with torch.cuda.stream(stream):
                    dst[a:b].copy_(staging[k][:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[k] = ev
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    try:
        ts = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    torch.cuda.synchronize(dev)
    return {name: _typed(buf, info) for name, (buf, info) in bufs.items()}
