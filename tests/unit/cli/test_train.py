"""The train command's summary lines."""

from lorakit.cli.train import check_facts, gpu_memory_line
from lorakit.config import assemble
from lorakit.plan.resolve import Resolved


def test_the_summary_puts_each_processes_gpu_peak_beside_the_plans_estimate():
    one = {"peak_gpu_gib": 45.23, "memory_estimate": {"gib": 47.1}}
    assert gpu_memory_line(one) == "GPU memory: 45.2 GiB at peak (planned 47.1 GiB)"
    two = {**one, "per_rank": [{"peak_gpu_gib": 45.23}, {"peak_gpu_gib": 44.91}]}
    assert gpu_memory_line(two) == "GPU memory per process: 45.2, 44.9 GiB at peak (planned 47.1 GiB each)"
    assert gpu_memory_line({**one, "memory_estimate": None}) == "GPU memory: 45.2 GiB at peak"


def test_a_cpu_run_says_nothing_of_gpu_memory():
    assert gpu_memory_line({"peak_gpu_gib": None, "memory_estimate": None}) is None
    assert gpu_memory_line({}) is None
    assert gpu_memory_line({"peak_gpu_gib": None, "per_rank": [{"peak_gpu_gib": None}] * 2}) is None


def test_the_checks_line_says_how_long_a_first_runs_attention_measurement_took_of_it():
    """A small card's first run measures its attention inside its checks (25-28 s of them on one H200 for
    Qwen-Image at 24 GiB, 2026-12-01): the line says how long that took and that it is once per machine."""
    cfg, _ = assemble(None, ["model.family=qwen-image", "memory.attention=cudnn"], profile="rtx4090")
    r = Resolved(cfg, {}, "cuda", attention_measured_s=12.34)
    assert check_facts(r) == {"profile": "rtx4090", "attention": "cudnn, measured in 12.3 s of this check: the "
                                                                 "first run of qwen-image here, kept for the next"}
    r.attention_measured_s = None  # measured on an earlier run
    assert check_facts(r)["attention"] == "cudnn"
    r.attention_deferred = True  # a card with room: beside the loading
    assert check_facts(r)["attention"] == "measured while the run starts"
