import json
import sys

import pytest
from typer.testing import CliRunner

from lorakit.bench.ways import compare_numerics, model_flops, synthetic_batch
from lorakit.cli.app import app
from lorakit.models.batch import drop_full_mask


@pytest.mark.parametrize("family", ["flux", "qwen-image-edit"])
def test_lorakit_step_equals_plain_step_on_cpu(family):
    # same weights, LoRA, inputs, sigma and noise: lorakit's loss_on (fp32 LoRA, autocast off on CPU, the mask
    # dropped when it masks nothing) gives the plain diffusers + peft loss and LoRA gradients
    r = compare_numerics(family)
    assert r["tensors"] >= 8
    assert r["loss_lorakit"] == pytest.approx(r["loss_plain"], rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_optimised_step_matches_plain_step_in_bf16(family):
    # on the GPU: compiled blocks, fp32 LoRA under bf16 autocast vs the plain bf16 step
    r = compare_numerics(family, device="cuda:0", dtype_name="bf16", sets=["memory.compile=true"])
    assert r["compiled"]
    assert r["loss_lorakit"] == pytest.approx(r["loss_plain"], rel=2e-2)
    assert r["grad_rel_diff"] < 5e-2


@pytest.mark.slow
def test_full_size_flops_are_the_published_architectures():
    # FLUX.1-dev at 1024²: ~74 TFLOP forward (12 B parameters, 4608 tokens, attention included)
    f = model_flops("flux", "full", 1024)
    assert 1.3e14 < f < 1.7e14
    assert model_flops("qwen-image", "full", 512) < model_flops("qwen-image", "full", 1024) / 2


def test_a_video_step_plans_the_clip_it_runs():
    """--frames reaches the synthetic batch and lorakit's config alike: the memory plan is made for the clip the
    step runs (a plan for the default 17 frames recomputed 28 of Wan 2.1's 40 blocks for a one-frame batch)."""
    from lorakit.bench.ways import lorakit_config

    spec = dict(family="wan2.1-t2v", size="tiny", res=64, rank=4, seed=0, warmup=0, steps=1, dtype="fp32", sets=[],
                profile="cpu", frames=5)
    assert lorakit_config(spec, "cpu").data.frames == 5
    assert synthetic_batch("wan2.1-t2v", "tiny", 64, frames=5).latents.shape[2] == 2  # (5 - 1) / 4 + 1 latent frames
    assert model_flops("wan2.1-t2v", "tiny", 64, frames=5) > model_flops("wan2.1-t2v", "tiny", 64)


def test_a_full_fine_tune_counts_the_weights_gradients():
    """A full fine-tune's step computes the weights' gradients as well: 3x the forward where LoRA's is 2x."""
    assert model_flops("wan2.1-t2v", "tiny", 64, full=True) == pytest.approx(1.5 * model_flops("wan2.1-t2v", "tiny", 64))


def test_full_mask_is_dropped_only_when_it_masks_nothing():
    b = synthetic_batch("qwen-image", "tiny", 64)
    assert "prompt_embeds_mask" not in drop_full_mask(b).text
    b.text["prompt_embeds_mask"][0, -3:] = 0
    assert "prompt_embeds_mask" in drop_full_mask(b).text


@pytest.mark.slow
def test_bench_step_cli_on_tiny_model():
    r = CliRunner().invoke(app, ["bench", "step", "--tiny", "--family", "qwen-image", "--res", "64", "--steps", "2",
                                 "--warmup", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{"):])
    assert [row["way"] for row in data["rows"]] == ["plain", "lorakit"]
    for row in data["rows"]:
        assert row["s_per_step"] > 0 and len(row["losses"]) == 3, row
        assert len(row["times_s"]) == row["steps_timed"] == 2 and row["min_s"] == min(row["times_s"])  # each step
        assert all(x == x for x in row["losses"])  # finite
    assert data["rows"][1]["speedup_vs_plain"] > 0
    assert data["rows"][1]["settings"]["compiled_recompute"] is False  # in force, as resolved (the CPU compiles none)


@pytest.mark.parametrize("args, words", [
    (["--family", "kandinsky", "--tiny"], "unknown model family"),
    (["--tiny", "--ways", "fast"], "unknown way"),
    (["--tiny", "--res", "100"], "multiple of 16"),
    (["--device", "cpu"], "would take hours"),
    (["--tiny", "--frames", "5"], "flux trains images"),
    (["--tiny", "--family", "wan2.1-t2v", "--frames", "6"], "4k + 1 frames"),
    (["--tiny", "--gpus-only"], "needs --gpus 2"),
])
def test_bench_step_bad_input(args, words):
    r = CliRunner().invoke(app, ["bench", "step", *args])
    assert r.exit_code == 2 and words in r.output, r.output


@pytest.mark.slow
def test_bench_step_on_two_processes_saves_resumes_and_continues(tmp_path):
    # --gpus 2 on a CPU: two gloo processes, FSDP for method=full; the checkpoint written mid-run is read back and
    # the steps after it repeat exactly
    r = CliRunner().invoke(app, ["bench", "step", "--tiny", "--device", "cpu", "--family", "flux", "--res", "128",
                                 "--steps", "2", "--warmup", "1", "--ways", "lorakit", "--gpus", "2",
                                 "--set", "method=full", "--checkpoint-dir", str(tmp_path / "ck"), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [(x["way"], x["gpus"]) for x in rows] == [("lorakit", 1), ("lorakit", 2)]
    said = r.stderr.splitlines()  # each measurement as it was made (rank 0's only), stdout the JSON alone
    assert sum(ln.startswith("bench step: lorakit") for ln in said) == 2, said
    assert sum(ln.startswith("bench checkpoint: background save: {") for ln in said) == 6, said
    assert sum(ln.startswith("bench checkpoint: synchronous save from the pinned buffers") for ln in said) == 2
    assert all("error" not in x for x in rows), rows
    assert rows[1]["throughput_vs_1gpu"] > 0 and rows[1]["method"] == "full"
    for x in rows:
        ck = x["checkpoint"]
        assert ck["losses_after_save"] == ck["losses_after_resume"] and ck["exact"]
        # three background saves beside the steps, each timed (the first pins its buffers, the others reuse them;
        # the third with 2 writer threads a rank)
        assert [a["writers"] for a in ck["async"]] == [8, 8, 2]
        assert all(a["background_s"] >= a["blocking_s"] >= 0 for a in ck["async"])
        assert all(len(a["steps_during_write_s"]) == 8 for a in ck["async"]) and ck["save_from_buffers_s"] > 0
    files = rows[1]["checkpoint"]["shard_files"]  # sharded: each of the 2 ranks wrote its own shards
    assert ".metadata" in files and {f.split("_")[2] for f in files if f.endswith(".distcp")} == {"0", "1"}
    assert not list((tmp_path / "ck" / "checkpoints").glob("step-*"))  # each removed after its measurement


def test_gap_report_finds_where_the_gpu_waited():
    from types import SimpleNamespace as NS

    from lorakit.bench.trace import gap_report

    def k(s, e, name, dev="DeviceType.CUDA"):
        return NS(time_range=NS(start=s, end=e), name=name, device_type=dev)
    # two overlapping kernels, a 5 us gap, a kernel, a 2 ms gap (a sync), a last kernel; CPU ops are ignored
    ev = [k(0, 100, "a"), k(50, 120, "b"), k(125, 200, "c"), k(2200, 2300, "d"), k(0, 5000, "cpu", "DeviceType.CPU")]
    lines = gap_report(ev)
    assert "idle 2.0 ms" in lines[0] and "in 2 gaps" in lines[0] and "1 of 1000-" in lines[0]
    assert "after 'c' before 'd'" in lines[1] and "2.000 ms" in lines[1]
    assert "after 'b' before 'c'" in lines[2]
    assert gap_report([k(0, 1, "x", "DeviceType.CPU")]) == ["no kernels recorded"]


def test_a_child_out_of_memory_keeps_torchs_message_and_where(monkeypatch):
    import subprocess

    from lorakit.bench import step as st

    err = ("Traceback (most recent call last):\n"
           '  File "/x/lorakit/train/loop.py", line 112, in train_step\n    loss.backward()\n'
           '  File "/x/torch/_tensor.py", line 9, in backward\n'
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
           "of 79.19 GiB of which 0 bytes is free. 31.2 GiB allowed; 30.9 GiB allocated by PyTorch\n")
    popen = subprocess.Popen

    def child_saying(text):  # the child: a process that writes `text` to its stderr and exits 1
        return lambda cmd, **k: popen([sys.executable, "-c", f"import sys; sys.stderr.write({text!r}); sys.exit(1)"],
                                      **k)

    monkeypatch.setattr(subprocess, "Popen", child_saying(err))
    r = st._child({"way": "lorakit"}, 30)
    assert r["error"] == "out of memory" and "Tried to allocate 1.50 GiB" in r["detail"]
    assert r["where"].startswith('File "/x/lorakit/train/loop.py", line 112')
    monkeypatch.setattr(subprocess, "Popen", child_saying("ValueError: no\n"))
    assert st._child({"way": "plain"}, 30) == {"way": "plain", "error": "ValueError: no"}


def test_the_lorakit_way_takes_the_attention_lorakit_train_takes_here(monkeypatch):
    from lorakit.bench import step as step_mod

    asked = []

    def backend(cfg, device):  # plan.decide.attention_backend: the self-test's choice for this family and size
        asked.append((cfg.model.family, cfg.data.resolution, cfg.profile, device))
        return {"flux": "cudnn", "qwen-image": "auto"}[cfg.model.family]
    monkeypatch.setattr(step_mod, "attention_backend", backend)
    assert step_mod.train_attention("flux", 768, None, "cuda:0") == "cudnn"
    assert step_mod.train_attention("qwen-image", 1024, "rtx4090", "cuda:1") is None  # PyTorch picks: the bench's own
    assert asked == [("flux", 768, "datacenter", "cuda:0"), ("qwen-image", 1024, "rtx4090", "cuda:1")]


def test_the_step_table_names_each_ways_attention_kernel():
    from lorakit.cli import bench as bench_cli
    from lorakit.cli.common import console

    row = dict(way="lorakit", gpus=1, s_per_step=0.345, items_per_s=2.9, peak_gib=41.4, mfu=0.436, checkpointing=False)
    result = dict(family="flux", res=1024, size="full", profile="datacenter", memory_cap_gib=None, steps=10,
                  environment={"device": "NVIDIA H200"},
                  rows=[dict(row, way="plain", attention="flash"), dict(row, attention="cudnn"),
                        dict(row, way="lorakit", attention=None)])
    with console.capture() as cap:
        bench_cli._render_step(result)
    lines = [ln for ln in cap.get().splitlines() if ln.startswith("│")]
    assert "attention" in cap.get() and len(lines) == 3
    assert "flash" in lines[0] and "cudnn" in lines[1] and "PyTorch's pick" in lines[2]


def test_the_lorakit_way_keeps_what_it_built_out_of_the_collector_as_lorakit_train_does(monkeypatch):
    """`lorakit train` freezes what the run keeps after its first step (`train.gcpause`), so later full collections
    do not walk the model and its compiled graphs (each a pause of tenths of a second with the GPU idle). `bench
    step`'s lorakit way did not: 7 of 80 timed Qwen-Image rtx4090 steps took 0.94-1.19 s against a 0.607 median,
    one every 11-12 steps (one H200, 2026-12-01), the pattern the run's own collections made before it froze them.
    Now it does the same after its warm-up; the plain way collects as Python does. Both say how long full
    collections took in the timed steps (`gc_s`)."""
    import gc

    from lorakit.bench import ways

    frozen = []

    def step():
        frozen.append(gc.get_freeze_count())
        gc.collect()  # a full collection inside every step
        return 1.0

    monkeypatch.setattr(ways, "prepare", lambda spec: (step, {}))
    out = {}
    for way in ("plain", "lorakit"):
        frozen.clear()
        out[way] = ways.run_way({"way": way, "device": "cpu", "warmup": 2, "steps": 3})
        assert frozen[:2] == [0, 0]  # the warm-up runs as built
        assert all(n > 0 for n in frozen[2:]) if way == "lorakit" else not any(frozen)
        assert out[way]["steps_timed"] == 3 and gc.get_freeze_count() == 0  # unfrozen after it
    assert out["plain"]["gc_s"] > 0 and out["lorakit"]["gc_s"] < out["plain"]["gc_s"] / 5


def test_region_report_sets_each_regions_host_time_beside_its_kernels_time():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lorakit.bench.trace import region_report

    m = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(m.parameters())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            m(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    lines = region_report(prof.events(), steps=2)
    assert lines[0].startswith("host against GPU by region, per step")
    step = next(ln for ln in lines if ln.endswith("Optimizer.step#AdamW.step"))  # numbers folded: one row
    assert "GPU      0.0" in step and " 1 calls" in step  # no kernels on a CPU; one call per step
    host = float(step.split()[1])
    assert host > 0
    assert any(ln.endswith("aten::linear") for ln in lines)  # the forward's outermost operator, beside it


def test_region_report_counts_outermost_operators_once_per_thread_with_their_childrens_kernels():
    from types import SimpleNamespace as NS

    from lorakit.bench.trace import region_report

    def op(name, thread, host_us, gpu_us, kernels=0, children=(), parent=None):
        e = NS(name=name, thread=thread, device_type="DeviceType.CPU", is_async=False, cpu_parent=parent,
               cpu_time_total=host_us, device_time_total=gpu_us, kernels=[object()] * kernels,
               cpu_children=list(children))
        for c in children:
            c.cpu_parent = e
        return e

    # thread 1: two compiled blocks a step (host 3 ms, 1 ms of kernels in a child op each) over 2 steps; thread 2:
    # one backward a step, the GPU's (host 2 ms, 5 ms of kernels); a kernel event itself is no host region
    inner = [op("aten::mm", 1, 500, 1000, kernels=3) for _ in range(4)]
    blocks = [op(f"Torch-Compiled Region: {i}/1", 1, 3000, 1000, kernels=1, children=[c]) for i, c in
              enumerate(inner)]
    back = [op("autograd::engine::evaluate_function: CompiledFunctionBackward", 2, 2000, 5000) for _ in range(2)]
    kernel = NS(name="gemm", thread=1, device_type="DeviceType.CUDA", is_async=False, cpu_parent=None)
    lines = region_report([*blocks, *inner, *back, kernel], steps=2)
    assert lines[0].endswith("2 threads")
    assert lines[1] == "  thread 1: host 6.0, GPU 2.0"  # the children's time not counted twice
    assert lines[2].split() == ["host", "6.0", "GPU", "2.0", "2", "calls", "8", "kernels", "Torch-Compiled",
                                "Region:", "#/#"]  # the block's own kernel and its child's three, a step
    assert lines[3] == "  thread 2: host 2.0, GPU 5.0" and lines[4].endswith("CompiledFunctionBackward")
    assert len(lines) == 5
