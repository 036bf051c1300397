import json

import pytest
import safetensors.torch as st
import torch

from lorakit.errors import InputError
from lorakit.io import load, read_header, resolve_files, save, save_sharded

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        x = torch.randn(3 + i, 5, generator=g) * 4
        out[f"t.{i}.{str(dt)[6:]}"] = x.to(dt) if dt != torch.bool else x > 0
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    out["big"] = torch.randn(1000, 300, generator=g)  # several chunks once CHUNK is small
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("backend", ["lorakit", "safetensors", "auto"])
def test_bit_exact_with_safetensors_for_every_dtype(tmp_path, backend, monkeypatch):
    import lorakit.io.reader as reader

    monkeypatch.setattr(reader, "CHUNK", 4096)  # force multi-chunk reads on small files
    ref = sample()
    st.save_file(ref, tmp_path / "ref.safetensors")
    same(load(tmp_path / "ref.safetensors", backend=backend), st.load_file(tmp_path / "ref.safetensors"))


def test_private_copies_are_bit_exact_too(tmp_path, monkeypatch):
    import lorakit.io.reader as reader

    monkeypatch.setattr(reader, "CHUNK", 4096)
    ref = sample(2)
    st.save_file(ref, tmp_path / "ref.safetensors")
    same(load(tmp_path / "ref.safetensors", copy=True, threads=3), ref)


def test_writing_a_mapped_tensor_never_changes_the_file(tmp_path):
    st.save_file({"a": torch.zeros(1000)}, tmp_path / "f.safetensors")
    before = (tmp_path / "f.safetensors").read_bytes()
    t = load(tmp_path / "f.safetensors")["a"]
    t += 1
    assert (tmp_path / "f.safetensors").read_bytes() == before
    assert float(load(tmp_path / "f.safetensors")["a"].sum()) == 0.0


def test_fastsafetensors_backend_to_cpu(tmp_path):
    ref = {k: v for k, v in sample().items() if v.numel() and v.dtype != torch.bool}
    st.save_file(ref, tmp_path / "a.safetensors")
    same(load(tmp_path / "a.safetensors", backend="fastsafetensors"), ref)


def test_our_files_are_read_by_safetensors_and_keep_metadata(tmp_path):
    ref = sample(1)
    save(ref, tmp_path / "ours.safetensors", metadata={"format": "pt", "lorakit": "1"})
    same(st.load_file(tmp_path / "ours.safetensors"), ref)
    assert read_header(tmp_path / "ours.safetensors").metadata == {"format": "pt", "lorakit": "1"}
    from safetensors import safe_open

    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "lorakit": "1"}


def test_save_is_atomic_and_leaves_no_temp_on_failure(tmp_path):
    target = tmp_path / "x.safetensors"
    save({"a": torch.ones(2)}, target)

    class Boom(dict):
        def items(self):
            yield "a", torch.ones(3)
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save(Boom(), target)
    assert torch.equal(st.load_file(target)["a"], torch.ones(2))  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_sharding_writes_a_diffusers_index_and_reads_back(tmp_path):
    ref = {f"w{i}": torch.randn(64, 64) for i in range(6)}  # 16 KiB each
    out = save_sharded(ref, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 64 * 64 * 4
    assert sorted(set(index["weight_map"].values())) == [p.name for p in out[:-1]]
    assert out[0].name == "diffusion_pytorch_model-00001-of-00003.safetensors"
    same(load(tmp_path), ref)
    assert resolve_files(tmp_path) == out[:-1]
    # saving again unsharded removes the stale shards and index
    save_sharded(ref, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diffusion_pytorch_model.safetensors"]


def test_diffusers_loads_a_transformer_we_resharded(tiny, tmp_path):
    from diffusers import FluxTransformer2DModel

    src = tiny("flux") / "transformer"
    sd = load(src)
    save_sharded(sd, tmp_path, max_shard_bytes=sum(v.numel() * v.element_size() for v in sd.values()) // 2)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    m = FluxTransformer2DModel.from_pretrained(tmp_path)
    same({k: v for k, v in m.state_dict().items()}, {k: sd[k] for k in m.state_dict()})


def test_dtype_cast_and_key_selection(tmp_path):
    st.save_file({"a": torch.randn(4), "b": torch.arange(3)}, tmp_path / "f.safetensors")
    out = load(tmp_path / "f.safetensors", dtype=torch.bfloat16, keys=["a", "b"])
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.int64  # ints are never cast
    with pytest.raises(InputError, match="not in the files: c"):
        load(tmp_path / "f.safetensors", keys=["c"])


def test_folder_errors(tmp_path, tiny):
    with pytest.raises(InputError, match="no .safetensors"):
        load(tmp_path)
    with pytest.raises(InputError, match="whole pipeline folder"):
        load(tiny("flux"))
    with pytest.raises(InputError, match="no such file"):
        load(tmp_path / "nope.safetensors")


@pytest.mark.gpu
@pytest.mark.parametrize("threads, chunk_mib", [(1, 1), (3, 1), (16, 16)])
def test_gpu_path_is_bit_exact_with_safetensors(tmp_path, monkeypatch, threads, chunk_mib):
    # pinned double buffers + async copies on per-thread streams: every dtype, a tensor spanning many chunks,
    # tensors smaller than a chunk, the empty one, a sharded folder
    monkeypatch.setenv("LORAKIT_IO_THREADS", str(threads))
    monkeypatch.setenv("LORAKIT_IO_CHUNK_MIB", str(chunk_mib))
    ref = sample(3)
    ref["huge"] = torch.randn(3 * 2**20 + 17, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    save_sharded(ref, tmp_path / "m", max_shard_bytes=4 * 2**20)
    got = load(tmp_path / "m", device="cuda:0", backend="lorakit")
    assert all(v.device.type == "cuda" for v in got.values())
    want = {}
    for f in resolve_files(tmp_path / "m"):
        want.update(st.load_file(f, device="cuda:0"))
    same({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()})
