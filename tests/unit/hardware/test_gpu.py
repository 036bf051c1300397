"""The GPU a process computes on and the settings that hold for the whole process."""

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


def test_the_cap_is_the_budget(monkeypatch):
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    assert budget_gib("cuda") == 24.0
