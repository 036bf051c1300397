"""`lorakit bench matrix` on the tiny models (the full-size run is the GPU machine's): every stage a lorakit process,
the cell's figures recorded, the table written."""

import json
import math

import pytest
from typer.testing import CliRunner

from lorakit.bench.matrix import BEFORE, phases, psnr
from lorakit.cli.app import app


@pytest.mark.slow
def test_the_matrix_runs_a_cell_through_every_stage(tmp_path):
    r = CliRunner().invoke(app, ["bench", "matrix", "--tiny", "--family", "flux", "--out", str(tmp_path), "--steps",
                                 "4", "--stages", "cache,train,train-warm,infer,stock", "--json"])
    assert r.exit_code == 0, r.output
    (cell,) = json.loads(r.output)
    assert cell["status"] == "pass", cell["note"]
    assert set(cell["stages"]) == {"cache", "train", "train-warm", "infer", "stock"} and all(
        s["rc"] == 0 and s["s"] > 0 and s["rss_gib"] > 0 for s in cell["stages"].values())
    # private (anonymous) memory beside RSS, sampled while each stage ran: some, and never more than its RSS
    assert all(0 < s["private_gib"] <= s["rss_gib"] + 0.05 for s in cell["stages"].values())
    assert cell["first_step_s"] > 0 and cell["first_step_warm_s"] > 0
    assert 0 < cell["s_per_step_median"] <= cell["s_per_step_p90"]
    for stage in ("train", "train-warm"):  # where the first minutes went, phase by phase
        names = [name for name, _, _, _ in cell["stages"][stage]["phases"]]
        assert names[:6] == [BEFORE, "check config and machine", "cache", "load model", "prepare model",
                             "step 1"], names
    md = (tmp_path / "matrix.md").read_text()
    assert "- flux x cpu, train-warm: before the first phase (imports) " in md and "; load model " in md
    assert math.isfinite(cell["psnr_vs_stock"])  # bf16 both; lorakit's LoRA and the stock one's: close, not equal
    assert "| flux | cpu | pass |" in md and " / " in md.split("| flux | cpu | pass |")[1]


@pytest.mark.slow
def test_a_video_cell_compares_the_clips_frame_for_frame(tmp_path, tiny):
    # the matrix's infer and stock stages on the tiny Kandinsky 5 T2V with a LoRA: the stock pipeline's clip goes
    # through the same H.264 writer as `lorakit infer`'s, so equal frames give equal files (compared with a PNG of
    # the raw frame, the codec alone once read as a 24 dB difference)
    from lorakit.bench.matrix import Cell, run_cell
    from tests.loras import trained_like

    work = tmp_path / "cell"
    (work / "run").mkdir(parents=True)
    trained_like(tiny, "kandinsky5-t2v", work / "run" / "lora.safetensors", targets="attention")
    cell = run_cell(Cell("kandinsky5-t2v", "cpu", None), tiny("kandinsky5-t2v"), tmp_path / "data", work, steps=1,
                    res=64, frames=5, tiny=True, stages=("infer", "stock"))
    assert cell.status == "pass", cell.note
    assert cell.psnr_vs_stock == float("inf") and (work / "stock.mp4").is_file()


def test_a_refusal_is_a_cell_result_not_a_crash(tmp_path):
    r = CliRunner().invoke(app, ["bench", "matrix", "--tiny", "--family", "flux", "--profile", "nope", "--out",
                                 str(tmp_path)])
    assert r.exit_code == 2 and "unknown family or profile 'nope'" in r.output
    assert psnr([[1, 2]], [[1, 2]]) == float("inf")


def test_the_phases_begin_with_what_came_before_the_first():
    log = "\n".join(['import time: 5 | 5 | x', json.dumps({"t": 10.45, "event": "phase", "name": "check config and "
                     "machine", "seconds": 5.34}), json.dumps({"t": 11.0, "event": "info", "message": "m"}),
                     json.dumps({"t": 43.04, "event": "phase", "name": "step 1", "seconds": 1.64, "step": None})])
    assert phases(log) == [[BEFORE, 5.11, 5.11, None], ["check config and machine", 5.34, 10.45, None],
                           ["step 1", 1.64, 43.04, None]]
    assert phases("no phases here") == []
