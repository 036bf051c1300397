"""Promises about the package itself."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_unpickling_torch_load_anywhere():
    offenders = []
    for p in (ROOT / "lorakit").rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{p.relative_to(ROOT)}:{i}")
    assert offenders == []


def test_profiles_are_package_resources():
    from importlib import resources

    names = sorted(p.name for p in resources.files("lorakit.profiles").iterdir() if p.name.endswith(".yaml"))
    assert names == ["cpu.yaml", "datacenter.yaml", "dgx-spark.yaml", "rtx4090.yaml", "rtx5090.yaml"]


@pytest.mark.slow
def test_wheel_ships_profiles_and_console_script(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("lorakit-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "lorakit = lorakit.cli.entry:main" in z.read(entry).decode()
    for prof in ("dgx-spark", "rtx4090", "rtx5090", "datacenter", "cpu"):
        assert f"lorakit/profiles/{prof}.yaml" in names
    assert "lorakit/cli/app.py" in names and not any(n.startswith("tests/") for n in names)


def test_pyproject_lists_every_package():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lorakit").rglob("__init__.py")}
    assert found | {"lorakit.profiles"} == listed
