"""Hostile and damaged files: a clear FileFormatError naming the file and the defect, never a crash."""

import json
import struct

import pytest
import safetensors.torch as st
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from lorakit.errors import FileFormatError, InputError
from lorakit.io import load, read_header


def raw_file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def entry(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


CASES = {
    "too short": (b"\x01\x02", "too short"),
    "header past end": (raw_file({"a": entry()}, b"\0" * 8, length=10_000), "runs past the end"),
    "huge header length": (raw_file({}, length=2**62), "exceeds"),
    "not json": (raw_file(b"{not json", b""), "not UTF-8 JSON"),
    "not utf8": (raw_file(b"\xff\xfe\x00", b""), "not UTF-8 JSON"),
    "json list": (raw_file(b"[1,2]", b""), "not an object"),
    "unknown dtype": (raw_file({"a": entry(dtype="F12")}, b"\0" * 8), "unknown dtype 'F12'"),
    "negative dim": (raw_file({"a": entry(shape=(-2,))}, b"\0" * 8), "invalid shape"),
    "offsets out of range": (raw_file({"a": entry(offs=(0, 800))}, b"\0" * 8), "outside the data region"),
    "size mismatch": (raw_file({"a": entry(shape=(3,))}, b"\0" * 8), "needs 12 bytes"),
    "overlap": (raw_file({"a": entry(offs=(0, 8)), "b": entry(offs=(4, 12))}, b"\0" * 12), "overlaps"),
    "gap": (raw_file({"a": entry(offs=(8, 16))}, b"\0" * 16), "gap of 8 bytes"),
    "truncated data": (raw_file({"a": entry(shape=(4,), offs=(0, 16))}, b"\0" * 8), "outside the data region"),
    "hostile shape": (raw_file({"a": entry(shape=(2**40, 2**20), offs=(0, 8))}, b"\0" * 8), "needs"),
    "bad metadata": (raw_file({"__metadata__": {"a": 1}}, b""), "__metadata__"),
    "entry not object": (raw_file({"a": 5}, b""), "not an object"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_defect_is_named(tmp_path, name):
    blob, needle = CASES[name]
    p = tmp_path / "bad.safetensors"
    p.write_bytes(blob)
    with pytest.raises(FileFormatError) as ei:
        load(p)
    assert str(p) in ei.value.message and needle in ei.value.message


def test_a_bad_shard_stops_the_load_before_any_read(tmp_path):
    st.save_file({"a": torch.ones(2)}, tmp_path / "m-1.safetensors")
    (tmp_path / "m-2.safetensors").write_bytes(CASES["gap"][0])
    with pytest.raises(FileFormatError, match="m-2"):
        load(tmp_path)


def _valid_bytes() -> bytes:

    t = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64),
         "h": torch.ones(2, 2, dtype=torch.bfloat16)}
    return st.save(t, metadata={"k": "v"})


VALID = _valid_bytes()


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(hs.data())
def test_fuzz_mutated_files_never_crash(tmp_path_factory, data):
    blob = bytearray(VALID)
    n_header = struct.unpack("<Q", blob[:8])[0]
    kind = data.draw(hs.sampled_from(["flip", "header_text", "length", "truncate", "extend"]))
    if kind == "flip":
        for _ in range(data.draw(hs.integers(1, 8))):
            i = data.draw(hs.integers(0, len(blob) - 1))
            blob[i] = data.draw(hs.integers(0, 255))
    elif kind == "header_text":
        text = blob[8:8 + n_header].decode()
        old = data.draw(hs.sampled_from(["3", "4", "12", "F32", "I64", "BF16", "data_offsets", "shape", ",", "]"]))
        new = data.draw(hs.sampled_from(["", "0", "-1", "99999999999", "1e9", "F8_E4M3", "null", "[]", "{}", '"x"']))
        text = text.replace(old, new, 1)
        raw = text.encode()
        blob = bytearray(struct.pack("<Q", len(raw)) + raw + bytes(blob[8 + n_header:]))
    elif kind == "length":
        blob[:8] = struct.pack("<Q", data.draw(hs.integers(0, 2**64 - 1)))
    elif kind == "truncate":
        blob = blob[:data.draw(hs.integers(0, len(blob) - 1))]
    else:
        blob += bytes(data.draw(hs.integers(1, 64)))
    p = tmp_path_factory.mktemp("fuzz") / "m.safetensors"
    p.write_bytes(bytes(blob))
    try:
        out = load(p)
    except (FileFormatError, InputError):
        return
    header = read_header(p)  # whatever loaded passed validation, so every tensor is fully backed
    assert set(out) == set(header.tensors)
    for name, t in out.items():
        assert t.numel() * t.element_size() == header.tensors[name].nbytes
