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
