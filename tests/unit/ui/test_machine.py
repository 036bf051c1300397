"""The machine panel's readings: nvidia-smi's answer parsed (a stand-in executable on PATH where this machine has no
GPU; the GPU hosts answer with the real one), its absence and its failures said, the host's memory and disk."""

import os
import stat

import pytest
from fastapi.testclient import TestClient

from lorakit.ui import machine as M
from lorakit.ui.server import create_app

LOCAL = "http://127.0.0.1"


def _smi(folder, body: str):
    exe = folder / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.fixture(autouse=True)
def _fresh():
    M._last.update(at=0.0, gpus=None)
    yield
    M._last.update(at=0.0, gpus=None)


def test_each_gpu_is_read_and_values_it_does_not_support_are_none(tmp_path, monkeypatch):
    _smi(tmp_path, "echo '0, NVIDIA H100 80GB HBM3, 30121, 81559, 97, 61, 512.33'\n"
                   "echo '1, NVIDIA H100 80GB HBM3, 0, 81559, 0, 33, [N/A]'\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    got = M.gpus()
    assert got["note"] is None and [g["index"] for g in got["gpus"]] == [0, 1]
    g0, g1 = got["gpus"]
    assert (g0["memory_used_mib"], g0["memory_total_mib"], g0["utilization_pct"], g0["temperature_c"],
            g0["power_w"]) == (30121, 81559, 97, 61, 512.33)
    assert g1["power_w"] is None and g1["name"] == "NVIDIA H100 80GB HBM3"


def test_no_nvidia_smi_and_a_failing_one_are_said(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing named nvidia-smi
    assert M.gpus() == {"gpus": [], "note": "no NVIDIA GPU here (nvidia-smi not found)"}
    M._last.update(at=0.0, gpus=None)
    _smi(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.' >&2\n"
                   "exit 9\n")
    got = M.gpus()
    assert got["gpus"] == [] and "could not communicate with the NVIDIA driver" in got["note"]


def test_the_dashboard_answers_with_the_machine(tmp_path):
    c = TestClient(create_app(tmp_path), base_url=LOCAL)
    m = c.get("/api/machine").json()
    assert set(m) == {"gpus", "note", "host"}
    h = m["host"]
    assert h["cpus"] == os.cpu_count() and h["memory_total_gib"] > 0 and 0 <= h["memory_available_gib"] <= \
        h["memory_total_gib"] and 0 < h["disk_free_gib"] <= h["disk_total_gib"]
    if not m["gpus"]:
        assert m["note"]


@pytest.mark.slow
def test_a_running_job_is_shown_on_the_gpu_of_its_slot(tmp_path, tiny, monkeypatch):
    """A queued run (the real queue, a tiny run) is named on the GPU it runs on, and on none once it has stopped."""
    import time

    from tests.unit.ui.conftest import run_yaml

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _smi(bin_, "echo '0, NVIDIA H100 80GB HBM3, 1024, 81559, 50, 40, 100.0'\n")
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    root = tmp_path / "runs"
    root.mkdir()
    run_yaml(root, tiny, root / "long", steps=4000, sampling={"enabled": False}, output={"save_every": 100000})
    with TestClient(create_app(root), base_url=LOCAL) as c:  # the queue starts with the app
        job = c.post("/api/jobs", json={"config": "long.yaml"}).json()
        assert job["state"] == "running", job
        M._last.update(at=0.0, gpus=None)
        gpu = c.get("/api/machine").json()["gpus"][0]
        assert gpu["job"] == {"id": job["id"], "run": "long"}
        c.post(f"/api/jobs/{job['id']}/stop")
        deadline = time.time() + 120
        while c.get("/api/jobs").json()["jobs"][0]["state"] == "running" and time.time() < deadline:
            time.sleep(0.2)
        M._last.update(at=0.0, gpus=None)
        assert c.get("/api/machine").json()["gpus"][0]["job"] is None
