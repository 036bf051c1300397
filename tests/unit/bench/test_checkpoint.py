"""`lorakit bench checkpoint` on the tiny architecture (CPU): every part times real saves, loads and the disk."""

import json

import pytest
from typer.testing import CliRunner

from lorakit.cli.app import app


def test_bench_checkpoint_times_each_part_asked_for(tmp_path):
    r = CliRunner().invoke(app, ["bench", "checkpoint", "--tiny", "--device", "cpu", "--family", "flux",
                                 "--dir", str(tmp_path / "bc"), "--parts", "sharded,async,disk", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["sharded_save_8_threads"]["files"] == 9 and out["sharded_load_cold"]["s"] > 0
    for save in ("async_save_first", "async_save_second"):  # lorakit's stager, its buffers kept for the second
        assert out[save]["background_s"] >= out[save]["copy_s"] >= 0
    assert {"write_gb_per_s", "read_gb_per_s", "write_2_streams_gb_per_s", "read_2_streams_gb_per_s"} <= set(
        out["disk"])
    assert "gathered_save" not in out and not list((tmp_path / "bc").iterdir())  # every file removed after


@pytest.mark.parametrize("args, words", [(["--parts", "sharded,zip"], "unknown part 'zip'"),
                                         (["--device", "cpu"], "add --tiny")])
def test_bench_checkpoint_bad_input(tmp_path, args, words):
    r = CliRunner().invoke(app, ["bench", "checkpoint", "--dir", str(tmp_path / "bc"), *args])
    assert r.exit_code == 2 and words in r.output, r.output
