"""The run folders as the dashboard reads them: status, progress and files, and paths kept inside the root."""

import os

import pytest

from lorakit.errors import InputError
from lorakit.io.lock import FolderLock, holder
from lorakit.ui import runs as R


@pytest.mark.slow
def test_each_status_and_its_progress_from_the_run_folders(runs):
    found = {str(p.relative_to(runs)): p for p in R.find_runs(runs)}
    assert set(found) == {"done", "team/stopped", "broken"}  # the run folders only, not their cache or data
    done = R.summary(found["done"], runs)
    assert done["status"] == "finished" and done["family"] == "flux" and (done["step"], done["steps"]) == (4, 4)
    assert done["loss"] > 0 and done["s_per_step"] > 0 and done["eta_s"] is None and done["holder"] is None
    stopped = R.summary(found["team/stopped"], runs)
    assert stopped["status"] == "interrupted" and (stopped["step"], stopped["steps"]) == (3, 3)
    assert R.summary(found["broken"], runs)["status"] == "failed"

    with FolderLock(found["broken"], "training run"):  # a process holding the folder is a running run
        s = R.summary(found["broken"], runs)
        assert s["status"] == "running" and s["holder"]["pid"] == os.getpid()
        assert s["s_per_step"] == 0.1 and s["eta_s"] == pytest.approx(0.2)  # 2 steps left; step 1's 30 s aside
    assert holder(found["broken"]) is None  # released with the lock


def test_the_run_page_lists_samples_checkpoints_and_files(runs):
    d = R.detail(runs / "done", runs)
    assert "model:" in d["config"] and d["samples"] and all(s.startswith("done/samples/") for s in d["samples"])
    names = {c["name"] for c in d["checkpoints"]}
    assert "final" in names and "done/lora.safetensors" in d["files"]
    assert any(f.endswith("/final/lora.safetensors") for c in d["checkpoints"] for f in c["files"])
    assert [m["step"] for m in R.read_metrics(runs / "done", since=2)] == [3, 4]


def test_paths_stay_inside_the_runs_folder(runs, tmp_path):
    assert R.confined(runs, "done/lora.safetensors") == (runs / "done" / "lora.safetensors").resolve()
    (tmp_path / "secret.txt").write_text("x")
    (runs / "done" / "escape").symlink_to(tmp_path)
    try:
        for bad in ("../etc/passwd", "/etc/passwd", "done/../../x", "done/escape/secret.txt"):
            with pytest.raises(InputError):
                R.confined(runs, bad)
        with pytest.raises(InputError):
            R.run_folder(runs, "done/samples")  # inside, but not a run
    finally:
        (runs / "done" / "escape").unlink()
