"""lorakit.pkgmap: `importlib.metadata.packages_distributions()` answered from a map kept between processes."""

import importlib.metadata as md
import json
import sys

import pytest

from lorakit import pkgmap


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The standard function restored after each test, the lorakit cache in tmp_path, a folder on the import path
    whose contents the test changes (as installing a distribution does)."""
    real = getattr(md.packages_distributions, "computed", md.packages_distributions)
    monkeypatch.setattr(md, "packages_distributions", real)
    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    calls = []

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(md, "packages_distributions", counted)
    return calls, site, real


def _a_new_process(monkeypatch, calls):
    """What a new process starts from: the standard (counting) function, not this one's cached one."""
    monkeypatch.setattr(md, "packages_distributions", md.packages_distributions.computed)


def test_the_map_is_computed_once_and_then_read_by_every_process(fresh, monkeypatch, tmp_path):
    calls, _, real = fresh
    pkgmap.use_cached_package_map()
    pkgmap.use_cached_package_map()  # idempotent
    first = md.packages_distributions()
    assert first == real() and len(calls) == 1
    assert "torch" in first and "yaml" in first  # the installed packages, by import name
    kept = list((tmp_path / "cache" / "packages").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == first
    first["torch"].append("changed")  # each caller gets its own copy
    assert "changed" not in md.packages_distributions()["torch"]

    _a_new_process(monkeypatch, calls)
    pkgmap.use_cached_package_map()
    assert md.packages_distributions() == real() and len(calls) == 1  # read, not computed


def test_installing_a_distribution_computes_the_map_again(fresh, monkeypatch, tmp_path):
    calls, site, _ = fresh
    pkgmap.use_cached_package_map()
    assert "lorakit_probe_pkg" not in md.packages_distributions()
    (site / "lorakit_probe_pkg").mkdir()  # a distribution installed in a folder on the import path
    (site / "lorakit_probe_pkg" / "__init__.py").write_text("")
    info = site / "lorakit_probe_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lorakit-probe-pkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("lorakit_probe_pkg\n")

    _a_new_process(monkeypatch, calls)
    pkgmap.use_cached_package_map()
    assert md.packages_distributions()["lorakit_probe_pkg"] == ["lorakit-probe-pkg"] and len(calls) == 2
    assert len(list((tmp_path / "cache" / "packages").glob("*.json"))) == 1  # the earlier path's map removed


def test_a_cache_that_cannot_be_written_still_answers(fresh, monkeypatch, tmp_path):
    calls, _, real = fresh
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    pkgmap.use_cached_package_map()
    assert md.packages_distributions() == real() and len(calls) == 1
