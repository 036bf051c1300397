"""Shared fixtures: tiny offline pipelines (built once per test session) and fake machines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # several workers share the cores: one thread each (children too)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """Where this session's tiny pipelines are built (LORAKIT_TEST_TINY reuses a folder across runs)."""
    keep = os.environ.get("LORAKIT_TEST_TINY")
    if keep:
        return Path(keep)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one folder for all workers of this run (builds are locked)
        return tmp_path_factory.getbasetemp().parent / "tiny"
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_root):
    """tiny("flux") -> folder of the tiny pipeline, built on first use in this session."""
    from lorakit.models.tiny import tiny_pipeline
    from lorakit.quiet import quiet_libraries

    quiet_libraries()
    return lambda family: tiny_pipeline(family, seed=0, root=tiny_root)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Commands that cache (attention self-test, tiny models) write under the test's tmp dir."""
    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "lorakit-cache"))
