"""Writing safetensors: atomic (temporary file, fsync, rename), with metadata, sharded above a size.

Files are byte-compatible with the safetensors format (8-byte header length, JSON header padded to a
multiple of 8 bytes, then the data in header order), streamed tensor by tensor: no second in-memory copy
of the whole checkpoint.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path

from lorakit.errors import InputError, environment_fault
from lorakit.io.header import TORCH_TO_ST


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it (other threads may be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(path: str | os.PathLike) -> None:
    """Give a file lorakit made (through a private temporary) the mode a plain `open()` or `mkdir` would have:
    0644 files and 0755 folders under the usual umask 022, so another user or a service (ComfyUI) can read it."""
    mode = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, mode & ~umask())


def shared_tree(root: str | os.PathLike) -> None:
    """`shared_mode` on a folder lorakit made and everything in it (copies keep their source's mode otherwise)."""
    for p in [Path(root), *Path(root).rglob("*")]:
        if not p.is_symlink():
            shared_mode(p)


TMP_SUFFIX = ".tmp"  # temporary siblings are ".<name>.<random>.tmp" (what `clean_orphans` removes)


class atomic_path:
    """`with atomic_path(target) as tmp:` write tmp; on success it is fsynced and renamed onto target.

    A write that fails for a machine reason (disk full, permissions, read-only disk) becomes an
    `EnvironmentFault` naming the target; the temporary file is removed and the target is left as it was. So it is
    when an interrupt (Ctrl-C, or a SIGTERM the run turns into one) arrives at any point: while the temporary file
    is being created, written, synced or renamed — the file is known by name before it exists."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise environment_fault(e, self.target) or e from None
        while True:
            self.tmp = self.target.parent / f".{self.target.name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
            try:  # 0666 less the umask: the finished file is readable as any other
                os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                return self.tmp
            except FileExistsError:
                continue
            except BaseException as e:  # an interrupt between the file's creation and here leaves nothing
                self._abandon(e)
                raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._abandon(exc)
            return False
        try:
            with open(self.tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(self.tmp, self.target)
        except BaseException as e:  # an OSError, or an interrupt before the rename: the target as it was
            self._abandon(e)
            raise
        _fsync_dir(self.target.parent)
        return False

    def _abandon(self, e: BaseException) -> None:
        """The temporary file removed, the target left as it was; a machine fault raised as the `EnvironmentFault`
        naming the target (anything else, an interrupt included, goes on as it is)."""
        self.tmp.unlink(missing_ok=True)
        fault = environment_fault(e, self.target) if isinstance(e, Exception) else None
        if fault is not None:
            raise fault from None


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`dst` as another name of the file `src` (a hard link: no bytes written), or a copy of it where the filesystem
    refuses links. Safe for lorakit's own files: none is written in place (`atomic_path` renames a new file over)."""
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def clean_orphans(folder: str | os.PathLike, recursive: bool = False, skip: tuple = ()) -> list[Path]:
    """Remove the temporary siblings a killed writer left in a folder (".<name>.<random>.tmp"), except under the
    folders in `skip` (another command's, swept under its own lock). Returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = "**/.*" + TMP_SUFFIX if recursive else ".*" + TMP_SUFFIX
    skip = tuple(Path(os.path.realpath(x)) for x in skip)
    gone = []
    for p in folder.glob(pattern):
        if skip and any(s in Path(os.path.realpath(p)).parents for s in skip):
            continue
        if p.is_file() and p.name.count(".") >= 3:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def _header(tensors: dict, metadata: dict | None) -> tuple[bytes, list]:
    doc: dict = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise InputError(f"safetensors metadata must map strings to strings; not: {bad[:3]}")
        doc["__metadata__"] = dict(metadata)
    order = []
    pos = 0
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InputError(f"tensor names must be strings, got {name!r}")
        st = TORCH_TO_ST.get(str(t.dtype).removeprefix("torch."))
        if st is None:
            raise InputError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        n = t.numel() * t.element_size()
        doc[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        order.append((name, t))
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, order


def save(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> Path:
    """Write one safetensors file atomically. Tensors may live on any device; shared storage is fine."""
    import torch

    raw, order = _header(tensors, metadata)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in order:
            if t.numel() == 0:
                continue
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if flat.device.type != "cpu":
                flat = flat.cpu()
            f.write(memoryview(flat.numpy()))
    return Path(path)


def save_sharded(tensors: dict, folder: str | os.PathLike, base: str = "diffusion_pytorch_model",
                 max_shard_bytes: int = 5 * 2**30, metadata: dict | None = None) -> list[Path]:
    """Write `folder/base.safetensors`, or shards + a diffusers-compatible `base.safetensors.index.json`
    when the tensors exceed `max_shard_bytes`. Shards fill in insertion order; a tensor larger than the
    limit gets a shard of its own. Stale shards of an earlier save with the same base are removed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    total = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        total += n
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    old = set(folder.glob(f"{base}*.safetensors")) | set(folder.glob(f"{base}.safetensors.index.json"))
    if len(shards) == 1:
        out = [save(shards[0], folder / f"{base}.safetensors", metadata)]
    else:
        k = len(shards)
        out, weight_map = [], {}
        for i, shard in enumerate(shards, 1):
            name = f"{base}-{i:05d}-of-{k:05d}.safetensors"
            out.append(save(shard, folder / name, metadata))
            weight_map.update({t: name for t in shard})
        index = folder / f"{base}.safetensors.index.json"
        with atomic_path(index) as tmp:
            tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        out.append(index)
    for stale in old - set(out):
        stale.unlink(missing_ok=True)
    return out
