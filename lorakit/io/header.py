"""Reading and validating safetensors headers, defensively.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON, then the data. Every
number in a header is checked against the file before anything is allocated, so a hostile or truncated
file gives a `FileFormatError` naming the file and the defect — never a crash, a hang or a multi-GB
allocation.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from lorakit.errors import FileFormatError

MAX_HEADER = 100_000_000  # bytes: the safetensors reference implementation's limit (MAX_HEADER_SIZE)

# safetensors dtype name -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
FLOATS = ("BF16", "F16", "F32", "F64")  # loaded at a run's dtype (the others as stored)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data region
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype][0])


@dataclass(frozen=True)
class Header:
    path: str
    data_start: int  # absolute file offset of the data region
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


def _bad(path: str, defect: str) -> FileFormatError:
    return FileFormatError(f"{path}: not a valid safetensors file: {defect}",
                           "re-download or re-save it; lorakit reads nothing from a damaged file")


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate a file's header (reads only the header bytes). Only regular files are opened: a FIFO
    or device named *.safetensors would block or stream forever."""
    import stat

    p = os.fspath(path)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket")
            raise FileFormatError(f"{p}: not a regular file: {kind}", "point at a .safetensors file")
        size = st.st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(p, f"{size} bytes is too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise _bad(p, f"header length {n} exceeds the {MAX_HEADER}-byte limit")
            if 8 + n > size:
                raise _bad(p, f"header length {n} runs past the end of the file ({size} bytes): truncated?")
            raw = f.read(n)
    except OSError as e:
        raise FileFormatError(f"{p}: cannot read: {e.strerror or e}") from None
    return parse_header(raw, p, size)


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def parse_header(raw: bytes, path: str, file_size: int) -> Header:
    """Validate header JSON bytes against the file size."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise _bad(path, f"the header names {str(e)!r} twice (which one is meant?)"[:300]) from None
    except RecursionError:
        raise _bad(path, "header JSON nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"header is not UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise _bad(path, f"header is a JSON {type(doc).__name__}, not an object")
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    meta = doc.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, e in doc.items():
        if not isinstance(e, dict):
            raise _bad(path, f"entry {name!r} is not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dt!r}"[:300])
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(type(d) is int and 0 <= d < 2**62 for d in shape)):
            raise _bad(path, f"tensor {name!r} has an invalid shape {shape!r}"[:300])
        if math.prod(d for d in shape if d) * DTYPES[dt][1] >= 2**62:  # sizes that overflow 64-bit arithmetic
            raise _bad(path, f"tensor {name!r}: shape {shape} of {dt} needs more bytes than any file holds"[:300])
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_size):
            raise _bad(path, f"tensor {name!r} has offsets {offs!r} outside the data region of {data_size} bytes"[:300])
        expect = math.prod(shape) * DTYPES[dt][1]
        if offs[1] - offs[0] != expect:
            raise _bad(path, f"tensor {name!r}: shape {shape} of {dt} needs {expect} bytes, offsets give "
                             f"{offs[1] - offs[0]}")
        tensors[name] = TensorInfo(name, dt, tuple(shape), offs[0], offs[1])
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise _bad(path, f"tensor {t.name!r} overlaps the tensor before it (offset {t.begin} < {pos})")
        if t.begin > pos:
            raise _bad(path, f"a gap of {t.begin - pos} bytes before tensor {t.name!r} (offset {pos})")
        pos = t.end
    if pos != data_size:
        raise _bad(path, f"the data region has {data_size} bytes, the tensors cover {pos}")
    return Header(path=path, data_start=data_start, file_size=file_size, tensors=tensors, metadata=dict(meta))
