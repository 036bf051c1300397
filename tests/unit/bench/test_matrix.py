"""`lorakit bench matrix` on the tiny models (the full-size run is the GPU machine's): every stage a lorakit process,
the cell's figures recorded, the table written."""

import json
import math

import pytest
from typer.testing import CliRunner

from lorakit.bench.matrix import BEFORE, gpu_peaks, phases, psnr
from lorakit.cli.app import app


def test_private_memory_counts_shared_anonymous_pages_as_pinned_memory_is_mapped():
    """cudaHostAlloc maps page-locked memory shared and anonymous: RAM the process holds, though not "Anonymous"."""
    import mmap
    import os

    from lorakit.bench.matrix import private_gib

    before = private_gib(os.getpid())
    held = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    held.write(b"x" * (64 * 2**20))  # every page touched: resident
    assert private_gib(os.getpid()) - before > 60 / 1024
    held.close()


@pytest.mark.slow
def test_the_matrix_runs_a_cell_through_every_stage(tmp_path):
    # the transformer kept on "another disk" (--home): every stage reads it through the model folder's link
    r = CliRunner().invoke(app, ["bench", "matrix", "--tiny", "--family", "flux", "--out", str(tmp_path), "--steps",
                                 "4", "--stages", "cache,train,train-warm,infer,stock", "--json",
                                 "--home", f"transformer={tmp_path / 'shm'}"])
    assert r.exit_code == 0, r.output
    linked = tmp_path / "models" / "flux" / "transformer"
    assert linked.is_symlink() and linked.resolve() == (tmp_path / "shm" / "flux" / "transformer").resolve()
    (cell,) = json.loads(r.output)
    assert cell["status"] == "pass", cell["note"]
    assert set(cell["stages"]) == {"cache", "train", "train-warm", "infer", "stock"} and all(
        s["rc"] == 0 and s["s"] > 0 and s["rss_gib"] > 0 for s in cell["stages"].values())
    # private (anonymous) memory beside RSS, sampled while each stage ran: some, and never more than its RSS
    assert all(0 < s["private_gib"] <= s["rss_gib"] + 0.05 for s in cell["stages"].values())
    assert cell["first_step_s"] > 0 and cell["first_step_warm_s"] > 0
    assert 0 < cell["s_per_step_median"] <= cell["s_per_step_p90"]
    by_size = cell["stages"]["train"]["by_size"]  # the same spread per bucket
    assert by_size and all("x" in k and 0 < m <= p and n >= 1 for k, (m, p, n) in by_size.items())
    for stage in ("train", "train-warm"):  # where the first minutes went, phase by phase
        names = [name for name, *_ in cell["stages"][stage]["phases"]]
        assert names[:6] == [BEFORE, "check config and machine", "cache", "load model", "prepare model",
                             "step 1"], names
        (final,) = [ph for ph in cell["stages"][stage]["phases"] if ph[0] == "final checkpoint (step 4)"]
        assert final[4].startswith("LoRA file ") and "read back as diffusers and ComfyUI read it" in final[4]
    md = (tmp_path / "matrix.md").read_text()
    assert "- flux x cpu, train-warm: before the first phase (imports) " in md and "; load model " in md
    assert "; final checkpoint (step 4) " in md
    assert cell["psnr_vs_stock"] == math.inf  # bf16 both, T5 loaded as transformers loads it: identical to stock
    assert cell["stages"]["stock"]["offload"] == "none"  # the stock pipeline offloads only a model larger than the GPU
    assert "| flux | cpu | pass |" in md and " / " in md.split("| flux | cpu | pass |")[1]


@pytest.mark.slow
def test_a_video_cell_compares_the_clips_frame_for_frame(tmp_path, tiny):
    # the matrix's infer and stock stages on the tiny Kandinsky 5 T2V with a LoRA: the stock pipeline's clip goes
    # through the same H.264 writer as `lorakit infer`'s, so equal frames give equal files (compared with a PNG of
    # the raw frame, the codec alone once read as a 24 dB difference)
    from lorakit.bench.cells import Cell
    from lorakit.bench.matrix import run_cell
    from tests.loras import trained_like

    work = tmp_path / "cell"
    (work / "run").mkdir(parents=True)
    trained_like(tiny, "kandinsky5-t2v", work / "run" / "lora.safetensors", targets="attention")
    cell = run_cell(Cell("kandinsky5-t2v", "cpu", None), tiny("kandinsky5-t2v"), tmp_path / "data", work, steps=1,
                    res=64, frames=5, tiny=True, stages=("infer", "stock"))
    assert cell.status == "pass", cell.note
    assert cell.psnr_vs_stock == float("inf") and (work / "stock.mp4").is_file()


@pytest.mark.parametrize("homes", [["transformer"], ["=/dev/shm"], ["transformer="], ["vae=/a", "vae=/b"]])
def test_a_home_that_is_not_component_equals_dir_once_is_refused(tmp_path, homes):
    r = CliRunner().invoke(app, ["bench", "matrix", "--tiny", "--family", "flux", "--out", str(tmp_path),
                                 *[x for h in homes for x in ("--home", h)]])
    assert r.exit_code == 2 and f"--home {homes[-1]!r}: not COMPONENT=DIR, or that component named twice" in r.output


def test_a_refusal_is_a_cell_result_not_a_crash(tmp_path):
    r = CliRunner().invoke(app, ["bench", "matrix", "--tiny", "--family", "flux", "--profile", "nope", "--out",
                                 str(tmp_path)])
    assert r.exit_code == 2 and "unknown family or profile 'nope'" in r.output
    assert psnr([[1, 2]], [[1, 2]]) == float("inf")


def test_the_phases_begin_with_what_came_before_the_first():
    log = "\n".join(['import time: 5 | 5 | x', json.dumps({"t": 10.45, "event": "phase", "name": "check config and "
                     "machine", "seconds": 5.34}), json.dumps({"t": 11.0, "event": "info", "message": "m"}),
                     json.dumps({"t": 43.04, "event": "phase", "name": "step 1", "seconds": 1.64, "step": None}),
                     json.dumps({"t": 60.0, "event": "phase", "name": "final checkpoint (step 1)", "seconds": 3.0,
                                 "of_which": "LoRA file 1.0 s, state.pt written 2.0 s"})])
    assert phases(log) == [[BEFORE, 5.11, 5.11, None, None], ["check config and machine", 5.34, 10.45, None, None],
                           ["step 1", 1.64, 43.04, None, None],
                           ["final checkpoint (step 1)", 3.0, 60.0, None, "LoRA file 1.0 s, state.pt written 2.0 s"]]
    assert phases("no phases here") == []


def test_a_refusal_naming_a_setting_is_followed_and_the_cell_runs_with_it(tmp_path, monkeypatch):
    # `lorakit train` refuses at the defaults with the hint a memory refusal gives; the matrix runs it again with
    # the named setting, and the cell says both (the train process is stood in for: its output is what is read)
    from lorakit.bench import matrix
    from lorakit.bench.cells import Cell, table
    from lorakit.bench.matrix import run_cell

    calls = []

    def fake(cmd, log, env, timeout):
        calls.append(cmd)
        log.with_suffix(".err").write_text("")
        if "--set" not in cmd:
            return 2, 1.0, 0.5, json.dumps({"error": "InputError", "message": "this run needs about 25.6 GiB of GPU "
                                            "memory and the rtx4090 profile has 24", "hint": "try --set "
                                            "memory.blocks_to_swap=5 (slower: those blocks' weights cross PCIe twice "
                                            "a step)"}), 0.4
        run = tmp_path / "cell" / "run"
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "time": 1e12, "s_per_step": 0.5 + i / 100})
                                                   + "\n" for i in range(1, 5)))
        return 0, 9.0, 3.0, json.dumps({"peak_gpu_gib": 21.0}), 1.5

    monkeypatch.setattr(matrix, "_run", fake)
    cell = run_cell(Cell("qwen-image-edit", "rtx4090", 24.0), tmp_path / "model", tmp_path / "data",
                    tmp_path / "cell", steps=4, res=64, frames=1, tiny=False, stages=("train",))
    assert len(calls) == 2 and calls[1][-2:] == ["--set", "memory.blocks_to_swap=5"]
    assert cell.status == "pass" and cell.sets == ["memory.blocks_to_swap=5"] and "25.6 GiB" in cell.refused
    assert cell.stages["train (refused at the defaults)"]["rc"] == 2 and cell.stages["train"]["rc"] == 0
    row = table([cell]).splitlines()[2]
    assert "| pass with --set memory.blocks_to_swap=5 (refused at the defaults: this run needs about 25.6 GiB" in row


def test_a_second_refusal_ends_the_cell_refused(tmp_path, monkeypatch):
    from lorakit.bench import matrix
    from lorakit.bench.cells import Cell, table
    from lorakit.bench.matrix import run_cell

    calls = []

    def fake(cmd, log, env, timeout):
        calls.append(cmd)
        log.with_suffix(".err").write_text("")
        return 2, 1.0, 0.5, json.dumps({"message": "needs 30 GiB", "hint": "try --set memory.blocks_to_swap=9"}), 0.4

    monkeypatch.setattr(matrix, "_run", fake)
    cell = run_cell(Cell("qwen-image-edit", "rtx4090", 24.0), tmp_path / "model", tmp_path / "data",
                    tmp_path / "cell", steps=4, res=64, frames=1, tiny=False, stages=("train", "infer"))
    assert len(calls) == 2 and cell.status == "refused" and cell.sets == ["memory.blocks_to_swap=9"]
    assert "infer" not in cell.stages  # nothing after a refusal the named setting did not lift
    row = table([cell]).splitlines()[2]
    assert "| refused also with --set memory.blocks_to_swap=9: needs 30 GiB (try --set" in row


def test_a_card_larger_than_this_gpu_runs_at_the_gpus_size_and_says_so(tmp_path, monkeypatch):
    from lorakit.bench import matrix

    monkeypatch.setattr(matrix, "_gpu_gib", lambda: 79.2)
    monkeypatch.setattr(matrix, "write_model", lambda *a, **k: pytest.fail("nothing is written past the limit"))
    cells = matrix.run_matrix(["flux"], ["dgx-spark", "rtx4090"], tmp_path, limit_s=-1)
    spark, small = cells
    assert spark.cap_gib is None and spark.note.startswith("this GPU has 79 GiB, less than the dgx-spark's 110")
    assert small.cap_gib == 24.0 and small.note == ""


def test_a_smaller_gpu_is_emulated_on_a_larger_one(tmp_path, monkeypatch):
    """--gpu-gib 80 on an H200: datacenter held to the H100's 80 GiB, dgx-spark run at it, the small cards as ever;
    a size at or above this GPU's emulates nothing."""
    from lorakit.bench import matrix

    monkeypatch.setattr(matrix, "_gpu_gib", lambda: 139.8)
    monkeypatch.setattr(matrix, "write_model", lambda *a, **k: pytest.fail("nothing is written past the limit"))
    dc, spark, small = matrix.run_matrix(["flux"], ["datacenter", "dgx-spark", "rtx5090"], tmp_path, limit_s=-1,
                                         gpu_gib=80)
    assert dc.cap_gib == 80 and dc.note == "held to 80 GiB: a smaller GPU emulated on this 140 GiB one"
    assert spark.cap_gib == 80 and spark.note.startswith("this GPU has 80 GiB (emulated), less than the dgx-spark's")
    assert small.cap_gib == 32.0 and small.note == ""
    dc, spark = matrix.run_matrix(["flux"], ["datacenter", "dgx-spark"], tmp_path, limit_s=-1, gpu_gib=200)
    assert dc.cap_gib is None and spark.cap_gib == 110.0 and dc.note == spark.note == ""


@pytest.mark.slow
def test_the_next_family_links_the_folder_before_it_where_it_holds_the_same_weights(tmp_path):
    """Full size: Qwen-Image-Edit-2511 after Qwen-Image links all three components (nothing written), FLUX after it
    links nothing (and the folder before is removed first, for the disk), a family run alone links a folder an
    earlier run kept; the tiny scale writes as before."""
    import torch

    from lorakit.bench import hub, matrix
    from lorakit.models.base import family_adapter

    prev = tmp_path / "qwen-image"
    prev.mkdir()
    adapter = family_adapter("qwen-image")
    pipe = adapter.build_tiny(0)
    comps = {name: {"identity": hub._identity(hub._build(adapter, name, part, pipe, "meta"), len(name),
                                              torch.bfloat16)}
             for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}
    (prev / "lorakit_synthetic.json").write_text(json.dumps({"components": comps}))
    assert matrix._like("qwen-image-edit-2511", prev, tmp_path, tiny=False, keep_models=False) == prev
    same, need = hub.reusable("qwen-image-edit-2511", prev, dtype=torch.bfloat16)
    assert sorted(same) == sorted(comps) and need == 0
    assert matrix._like("flux", prev, tmp_path, tiny=False, keep_models=False) is None
    # run alone after a run that kept its folder (in the same --models): that folder, found there
    assert matrix._like("qwen-image-edit-2511", None, tmp_path, tiny=False, keep_models=True) == prev
    assert matrix._like("qwen-image", None, tmp_path, tiny=False, keep_models=True) is None  # itself: never
    assert matrix._like("flux", None, tmp_path, tiny=False, keep_models=True) is None
    assert matrix._like("qwen-image-edit", prev, tmp_path, tiny=True, keep_models=False) is None


def test_a_cell_says_which_part_of_the_run_came_nearest_the_cards_edge():
    """The step records' own peaks (the steps', the other shapes' compile, the step-0 grid's): a Qwen-Image 24 GiB
    run's highest was its grid, not a step."""
    rows = [{"step": 1, "step_gpu_gib": 19.47, "compile_gpu_gib": 21.2, "grid_gpu_gib": 23.03, "gpu_gib": 23.03},
            {"step": 2, "step_gpu_gib": 20.1, "gpu_gib": 23.03}, {"step": 3, "step_gpu_gib": 19.9, "gpu_gib": 23.03}]
    assert gpu_peaks(rows) == {"step": 20.1, "compile": 21.2, "grid": 23.03}
    assert gpu_peaks([{"step": 1, "loss": 1.0}]) == {"step": None, "compile": None, "grid": None}  # the CPU
