"""The train command's summary lines."""

from lorakit.cli.train import gpu_memory_line


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
