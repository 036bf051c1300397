"""A Python that compiles the big libraries from source in every process (no cached bytecode, none written) is
named by `lorakit doctor` and `lorakit train`, with the one command that ends it."""

import compileall
import json
import sys

from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.hardware import bytecode
from lorakit.hardware import doctor as doc
from tests.unit.plan.test_resolve import _config


def _package(tmp_path, monkeypatch, name: str = "slowpkg"):
    """An installed package without bytecode (as uv installs it, or an image whose __pycache__ was removed)."""
    root = tmp_path / "site"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def test_a_package_without_bytecode_in_a_python_that_writes_none_is_named_with_the_command_that_ends_it(
        tmp_path, monkeypatch):
    root = _package(tmp_path, monkeypatch)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert bytecode.uncached(("slowpkg", "no_such_package_here"), dont_write=True) == ["slowpkg"]
    said = bytecode.note(("slowpkg",), dont_write=True)
    assert said.startswith("Python compiles slowpkg from source in every process here") and \
        "PYTHONDONTWRITEBYTECODE is set" in said and f"python -m compileall -q -j 0 {root} " in said
    (root / "slowmod.py").write_text("Y = 2\n")  # a module of one file: its folder is named, not the one above
    assert f"compileall -q -j 0 {root} " in bytecode.note(("slowmod",), dont_write=True)
    assert bytecode.uncached(("slowpkg",), dont_write=False) == []  # this Python writes it at the first import
    compileall.compile_dir(str(root / "slowpkg"), quiet=1)  # what the note says to run
    assert bytecode.uncached(("slowpkg",), dont_write=True) == [] and bytecode.note(("slowpkg",), True) is None


def test_doctor_warns_with_the_fix_and_says_ok_once_the_bytecode_is_there(tmp_path, monkeypatch):
    root = _package(tmp_path, monkeypatch)
    monkeypatch.setattr(bytecode, "PACKAGES", ("slowpkg",))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    got = []
    doc.bytecode_check(got.append)
    (c,) = got
    assert c.name == "bytecode" and c.status == doc.WARN and c.detail.startswith("slowpkg compiled from source in "
                                                                                 "every process")
    assert c.hint.startswith(f"once, as the folders' owner: python -m compileall -q -j 0 {root}")
    compileall.compile_dir(str(root / "slowpkg"), quiet=1)
    got.clear()
    doc.bytecode_check(got.append)
    assert got[0].status == doc.OK and got[0].detail == "cached (slowpkg)"


def test_a_training_run_says_it_before_it_starts(tmp_path, tiny, monkeypatch):
    _package(tmp_path, monkeypatch)
    monkeypatch.setattr(bytecode, "PACKAGES", ("slowpkg",))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    dry = CliRunner().invoke(app, ["train", str(_config(tmp_path, tiny)), "--profile", "cpu", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    notes = json.loads(dry.output)["notes"]
    assert [n for n in notes if n.startswith("Python compiles slowpkg from source in every process here")]
