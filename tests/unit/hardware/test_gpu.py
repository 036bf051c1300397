"""The GPU a process computes on and the settings that hold for the whole process."""

import os

import pytest

from lorakit.hardware.gpu import apply_cap, budget_gib, device_for, env_cap_gib


def test_memory_cap_from_the_environment(monkeypatch):

    from lorakit.errors import InputError

    monkeypatch.delenv("LORAKIT_MEMORY_CAP_GIB", raising=False)
    assert env_cap_gib() is None and apply_cap("cuda") is None
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    assert env_cap_gib() == 24.0 and apply_cap("cpu") is None  # a CPU has no allocator to hold back
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "lots")
    with pytest.raises(InputError, match="give the GiB"):
        env_cap_gib()


def test_the_cpu_profile_computes_on_the_cpu_whatever_the_machine():
    assert device_for("cpu") == "cpu"


def test_compiled_blocks_are_kept_in_lorakits_cache_unless_the_user_chose_a_folder(tmp_path, monkeypatch):
    from lorakit.hardware.gpu import compile_cache

    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "lk"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache() == str(tmp_path / "lk" / "compile") and (tmp_path / "lk" / "compile").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache() == str(tmp_path / "mine")


def test_inductors_own_default_is_not_taken_for_the_users_folder(tmp_path, monkeypatch):
    """Inductor writes its fallback folder into TORCHINDUCTOR_CACHE_DIR the first time anything asks it for its
    folder (`cache_dir()`); a run that asked before `compile_cache` still keeps its graphs in lorakit's cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from lorakit.hardware.gpu import compile_cache, compile_cache_dir

    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "lk"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir() and "torchinductor_" in os.environ["TORCHINDUCTOR_CACHE_DIR"]  # torch's own, set by torch
    assert compile_cache_dir() == str(tmp_path / "lk" / "compile")
    assert compile_cache() == str(tmp_path / "lk" / "compile") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert cache_dir() == str(tmp_path / "lk" / "compile")  # where Inductor now writes


def test_the_cap_is_the_budget(monkeypatch):
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    assert budget_gib("cuda") == 24.0
