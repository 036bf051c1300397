import json

import pytest
from typer.testing import CliRunner

from lorakit.bench.load import make_synthetic, parse_size
from lorakit.cli.app import app
from lorakit.errors import InputError
from lorakit.io import read_header


def test_parse_size():
    assert parse_size("8G") == 8 * 2**30 and parse_size("256M") == 256 * 2**20 and parse_size("1.5k") == 1536
    assert parse_size("100") == 100 and parse_size("2GiB") == 2 * 2**30
    with pytest.raises(InputError):
        parse_size("lots")


def test_synthetic_checkpoint_is_sharded_random_bf16(tmp_path):
    files = make_synthetic(tmp_path, 2 * 2**20, shards=2, tensors_per_shard=4)
    assert len(files) == 2
    h = read_header(files[0])
    assert {t.dtype for t in h.tensors.values()} == {"BF16"} and len(h.tensors) == 4
    assert len(set(files[0].read_bytes()[-4096:])) > 100  # random bytes, not zeros


def test_bench_load_cli_measures_every_way_bit_exact():
    r = CliRunner().invoke(app, ["bench", "load", "--synthetic", "4M", "--repeats", "1", "--target", "cpu",
                                 "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    ways = {(row["way"], row["cache"]) for row in data["rows"]}
    assert ways == {(w, c) for w in ("safetensors", "fastsafetensors", "lorakit", "lorakit-copy")
                    for c in ("warm", "cold")}
    assert all(row["exact"] is True and row["seconds"] > 0 for row in data["rows"])
    assert "posix_fadvise" in data["cold_method"]
    assert "drop_caches" not in data["cold_method"]  # the machine's page cache is left alone unless asked


def test_the_whole_page_cache_is_dropped_only_when_asked(tmp_path, monkeypatch):
    import builtins

    from lorakit.bench import load as L

    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 4096)
    opened = []
    real_open = builtins.open

    def spy(path, *a, **k):
        if str(path) == "/proc/sys/vm/drop_caches":
            opened.append(path)
            raise PermissionError("not here")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    L.drop_cache([f])
    assert opened == []
    L.drop_cache([f], machine_wide=True)
    assert opened == ["/proc/sys/vm/drop_caches"]


def test_bench_load_needs_input():
    r = CliRunner().invoke(app, ["bench", "load"])
    assert r.exit_code == 2 and "--synthetic" in r.output


def test_bench_model_dir_times_a_whole_pipeline(tiny):
    r = CliRunner().invoke(app, ["bench", "load", "--model-dir", str(tiny("flux")), "--repeats", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert set(data["components"]) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert [row["way"] for row in data["rows"]] == ["diffusers from_pretrained", "lorakit"]
    assert all(row["seconds"] > 0 for row in data["rows"])
