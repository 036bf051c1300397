"""What lorakit writes is readable as any other file of its user: 0644 files and 0755 folders under umask 022 (a
ComfyUI service or a colleague reads the LoRA), the umask's own choice under 077."""

import os
import stat
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset


def _modes(root):
    bad = []
    for p in [root, *root.rglob("*")]:
        if p.is_symlink() or p.name == ".lorakit.lock":
            continue
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o755 if p.is_dir() else 0o644
        if mode != want:
            bad.append(f"{p.relative_to(root)}: {oct(mode)}")
    return bad


def _lorakit(args, mask):
    """The command's own code under the umask `mask`, in this process (the umask is the process's: restored)."""
    old = os.umask(mask)
    try:
        return CliRunner().invoke(app, args)
    finally:
        os.umask(old)


@pytest.mark.slow
def test_a_run_converted_and_merged_files_honour_the_umask(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    out = tmp_path / "out"
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 2}, "sampling": {"steps": 2}, "output": {"dir": str(out), "save_every": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = _lorakit(["train", str(tmp_path / "run.yaml")], 0o022)
    assert r.exit_code == 0, r.output
    lora = out / "lora.safetensors"
    shared = tmp_path / "shared"
    for args in (["convert", "lora", str(lora), str(shared / "comfy.safetensors"), "--to", "comfyui", "--family",
                  "flux"],
                 ["convert", "merge", str(tiny("flux")), str(lora), str(shared / "merged")]):
        r = _lorakit(args, 0o022)
        assert r.exit_code == 0, r.output
    assert (out / "samples").is_dir() and (out / "checkpoints").is_dir() and (shared / "merged").is_dir()
    assert _modes(out) == [] and _modes(shared) == []


@pytest.mark.slow
def test_a_private_umask_is_kept(tmp_path, tiny):
    lora_dir = tmp_path / "private"
    code = ("import os, torch; os.umask(0o077); from lorakit.io import save; "
            f"save({{'w': torch.zeros(2)}}, {str(lora_dir / 'a.safetensors')!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert stat.S_IMODE((lora_dir / "a.safetensors").stat().st_mode) == 0o600
    assert os.access(lora_dir / "a.safetensors", os.R_OK)
