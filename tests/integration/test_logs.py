"""A training run as under nohup or SLURM (stdout to a file): it speaks while it runs — the phases with their
durations, then step lines — and a SIGTERM still ends it resumable (exit 75)."""

import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from lorakit.data.demo import make_demo_dataset


@pytest.mark.slow
def test_a_run_logging_to_a_file_names_each_phase_and_its_steps_while_running(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=3, size=[64, (96, 64), (64, 96)])
    out = tmp_path / ("a-long-output-folder-name-" * 4) / "run"
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 100000}, "sampling": {"prompts": ["a cat"], "every": 0, "steps": 2},
           "output": {"dir": str(out)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(tmp_path / "run.yaml")],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not re.search(r"step \d+/100000 ", log.read_text()):
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert proc.poll() is None  # said while running, not at the end
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc == 75, log.read_text()
    lines = text.splitlines()
    assert all(re.match(r"\[\s*\d+\.\d s\] ", x) for x in lines), text  # each line: seconds since the command began
    assert re.search(rf"training flux \(.*\) for 100000 steps on cpu, profile cpu, into {re.escape(str(out))}\n",
                     text)  # the whole path: nothing cut to 80 columns
    for phase in (r"check config and machine: \d+\.\d s \(profile cpu, attention \w+\)",
                  r"load encoders: \d+\.\d s \(\d+\.\d+ GiB, \d+\.\d+ GB/s\)",
                  r"cache: \d+\.\d s \(items 3, encoded 3, reused 0, skipped 0\)",
                  r"sample prompts: \d+\.\d s",
                  # the transformer's files read into the page cache since the config was checked
                  r"load model: \d+\.\d s \(\d+\.\d+ GiB, \d+\.\d+ GB/s, read ahead (\d+\.\d) of \1 MiB in "
                  r"\d+\.\d s( \(\d+\.\d+ GB/s\))?\)",
                  r"prepare model: \d+\.\d s \(trainable \d+, buckets 3(, of which [\w ,.-]+ \d+\.\d s)?\)",
                  r"step 1: \d+\.\d s \(size \d+x\d+\)"):
        assert re.search(phase, text), (phase, text)
    # step 1 is its own figure (it held the compile, the first allocations): no pace or ETA drawn from it
    assert re.search(r"step 1/100000  loss \d\.\d{4}  lr \d\.\de-\d\d  first step \d+\.\d\d s\n", text), text
    final = log.read_text()
    assert "samples (step 0): " in final  # the grid before training, rendered after step 1
    assert re.search(r"checkpoint \(step \d+\): \d+\.\d s", final), final
    assert "interrupted" in final.lower()
    for chatter in ("Warning", "Failed to load", "it/s]"):  # third-party warnings and progress bars stay out
        assert chatter not in final, final
