"""The package's structure holds: the import contract (layers, no cycles, imports at the top unless heavy; see
tests/architecture.py and docs/architecture.md), small modules, a training loop that reads top down."""

import shutil
from pathlib import Path

import pytest

from tests import architecture as A

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450
LOOP_MAX_LINES = 250


def test_the_package_keeps_its_import_contract():
    problems = A.violations()
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer_and_the_exceptions_stay_few_and_documented():
    g = A.build()
    for m in g.modules:
        A.layer_of(m)  # raises for a module no layer names
    assert len(A.EXCEPTIONS) <= 2
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for (a, b) in A.EXCEPTIONS:
        assert a in doc and b in doc, f"the exception {a} -> {b} is not explained in docs/architecture.md"
    for name, _ in A.LAYERS:
        assert f"| {name} |" in doc, f"layer {name} is not in docs/architecture.md's table"


@pytest.fixture
def copy_of_the_package(tmp_path):
    dst = tmp_path / "lorakit"
    shutil.copytree(ROOT / "lorakit", dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_an_upward_import_fails_the_contract(copy_of_the_package):
    _append(copy_of_the_package / "io" / "header.py", "\nfrom lorakit.train import loop  # noqa\n")
    problems = A.violations(copy_of_the_package)
    assert any("upward import: lorakit.io.header (io) imports lorakit.train.loop (train)" in p for p in problems)


def test_a_cycle_fails_the_contract(copy_of_the_package):
    _append(copy_of_the_package / "models" / "registry.py", "\n\ndef _x():\n    from lorakit.models import base  # noqa\n")
    problems = A.violations(copy_of_the_package)
    assert any(p.startswith("import cycle:") and "lorakit.models.registry" in p for p in problems), problems


def test_a_function_level_import_of_a_light_module_fails_the_contract(copy_of_the_package):
    _append(copy_of_the_package / "train" / "sampling.py", "\n\ndef _x():\n    from lorakit.errors import InputError  # noqa\n")
    problems = A.violations(copy_of_the_package)
    assert any("function-level import of a light module: lorakit.train.sampling imports lorakit.errors" in p
               for p in problems)


def test_modules_stay_small_and_the_loop_reads_top_down():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (ROOT / "lorakit").rglob("*.py")}
    big = {str(p): n for p, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
    assert sizes[Path("lorakit/train/loop.py")] <= LOOP_MAX_LINES


def test_no_test_hooks_in_product_code():
    """Behaviour for tests comes from monkeypatching in the tests, not from environment switches in lorakit."""
    hooks = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in (ROOT / "lorakit").rglob("*.py")
             for line in p.read_text().splitlines()
             if ("_TEST_" in line or "testing aid" in line.lower()) and not line.strip().startswith("#")]
    assert not hooks, hooks


def test_no_assert_statements_in_product_code():
    """Checks of input raise lorakit errors (an assert vanishes under python -O and says nothing to a user)."""
    import ast

    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in (ROOT / "lorakit").rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Assert)]
    assert not found, found
