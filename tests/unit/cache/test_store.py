"""The content-addressed store: keys hash every input, writes are atomic, damaged entries are found."""

import pytest
import torch

from lorakit.cache.store import Store, item_key


def test_key_changes_with_any_input_and_not_otherwise(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(b"pixels")
    base = dict(sources=[img], caption="a cat", identity="m1", settings={"dtype": "fp32"}, bucket=(64, 64))
    k = item_key(**base)
    assert k == item_key(**base)
    assert k != item_key(**{**base, "caption": "a dog"})
    assert k != item_key(**{**base, "identity": "m2"})
    assert k != item_key(**{**base, "settings": {"dtype": "bf16"}})
    assert k != item_key(**{**base, "bucket": (48, 80)})
    img.write_bytes(b"pixelz")
    assert k != item_key(**base)


def test_put_get_verify_prune(tmp_path):
    st = Store(tmp_path / "c")
    st.put("good", {"latents": torch.ones(2, 2)}, {"caption": "x"})
    st.put("nan", {"latents": torch.tensor([float("nan")])}, {})
    st.put("stale", {"latents": torch.zeros(1)}, {})
    (st.items_dir / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (st.items_dir / ".good.safetensors.123.tmp").write_bytes(b"half")  # left by a killed writer
    assert st.has("good") and not st.has("bad") and not st.has("missing")
    assert torch.equal(st.get("good")["latents"], torch.ones(2, 2))
    assert sorted(st.verify(["good", "nan", "bad", "missing"])) == ["bad", "missing", "nan"]
    assert st.prune({"good", "nan", "bad"}) == 1
    assert not any(st.items_dir.glob(".*.tmp")) and not st.path("stale").exists()


def test_manifest_of_another_version_reads_as_none(tmp_path):
    st = Store(tmp_path / "c")
    st.write_manifest({"items": []})
    assert st.read_manifest()["items"] == []
    (st.root / "manifest.json").write_text('{"version": 99, "items": []}')
    assert st.read_manifest() is None
    (st.root / "manifest.json").write_text("{broken")
    assert st.read_manifest() is None


def test_writer_writes_every_item_in_the_background_and_raises_a_failed_write(tmp_path, monkeypatch):
    s = Store(tmp_path)
    with s.writer(depth=2) as put:
        for i in range(5):
            t = torch.full((3,), float(i))
            put(f"k{i}", {"x": t}, {"i": i})
            t.add_(100)  # the caller reuses its tensor at once: the queued write holds its own host copy
    assert [s.get(f"k{i}")["x"].tolist() for i in range(5)] == [[float(i)] * 3 for i in range(5)]

    def broken(key, tensors, meta):
        raise OSError(28, "No space left on device", str(s.path(key)))

    monkeypatch.setattr(s, "put", broken)
    with pytest.raises(OSError, match="No space left") as err, s.writer() as put:
        put("k9", {"x": torch.zeros(1)}, {})
    assert err.value.filename == str(s.path("k9"))  # the error names the item file
