"""A matrix cell (lorakit.bench.cells): judged against the memory a shared-memory machine has, shown in the table."""

from lorakit.bench.cells import Cell, shared_check, table


def test_a_shared_memory_cell_must_fit_gpu_and_host_together():
    """dgx-spark: the CPU and GPU share 128 GB, so a stage's GPU peak and its private host memory count together
    (lorakit's stages; the stock pipeline is the reference); the table says how much of it the cell used."""
    def cell(train_private):
        c = Cell("qwen-image", "dgx-spark", 110.0, status="pass", peak_gpu_gib=73.0)
        c.stages = {"cache": {"peak_gpu_gib": 17.8, "private_gib": 1.3, "rss_gib": 16.0},
                    "train": {"private_gib": train_private, "rss_gib": 40.0},
                    "stock": {"peak_gpu_gib": 80.0, "private_gib": 60.0, "rss_gib": 70.0}}
        shared_check(c)
        return c

    ok = cell(2.0)
    assert ok.status == "pass" and ok.shared_gib == 75.0
    assert "pass (75 of the 119.2 GiB shared memory)" in table([ok])
    big = cell(50.0)
    assert big.status == "failed" and big.shared_gib == 123.0
    assert big.note.startswith("train needs 123.0 GiB of GPU and private host memory at once") and "119.2" in big.note
