"""A second doctor answers from this machine's earlier probe without importing torch (4 s on an H100 host)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import lorakit.hardware.probe as p
p.machine_key = lambda: {"gpus": ["Model: NVIDIA H100"], "driver": "580", "packages": {"torch": "%s"}}
f = p.probe("/tmp", use_cache=True)
print(json.dumps({"cached": f.cached, "torch_imported": "torch" in sys.modules, "torch": f.torch,
                  "cores": f.cpu_count}))
"""


def _run(tmp_path, torch_version="2.14.1"):
    env = {**os.environ, "LORAKIT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT % torch_version], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_second_probe_is_answered_without_torch_and_a_changed_machine_probes_again(tmp_path):
    first = _run(tmp_path)
    assert first == {**first, "cached": False, "torch_imported": True} and first["torch"]
    second = _run(tmp_path)
    assert second == {**first, "cached": True, "torch_imported": False}  # same facts, torch never loaded
    other = _run(tmp_path, "2.15.0")  # another torch (or driver, or GPU): probed again
    assert other["cached"] is False and other["torch_imported"] is True


def test_no_cache_without_a_way_to_list_the_gpus(tmp_path, monkeypatch):
    import lorakit.hardware.probe as p

    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(p, "machine_key", lambda: None)
    assert not p.probe("/tmp", use_cache=True).cached
    assert not p.probe("/tmp", use_cache=True).cached and not p.facts_cached()
