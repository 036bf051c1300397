"""The GPU a process computes on and the settings that hold for the whole process."""

import os

import pytest

from lorakit.hardware.gpu import apply_cap, budget_gib, compile_workers, device_for, env_cap_gib


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


@pytest.fixture
def compile_settings(monkeypatch):
    """`compile_cache` changes torch's settings and the environment: both as they were after the test."""
    import torch._functorch.config as functorch_config

    from lorakit.hardware.gpu import CUSTOM_AUTOGRAD_ENV

    monkeypatch.setenv(CUSTOM_AUTOGRAD_ENV, "0")
    monkeypatch.delenv(CUSTOM_AUTOGRAD_ENV)  # unset now; as it was after the test
    with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=False):  # torch's own undo
        yield functorch_config


def test_compiled_blocks_are_kept_in_lorakits_cache_unless_the_user_chose_a_folder(tmp_path, monkeypatch,
                                                                                  compile_settings):
    from lorakit.hardware.gpu import compile_cache

    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "lk"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache() == str(tmp_path / "lk" / "compile") and (tmp_path / "lk" / "compile").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache() == str(tmp_path / "mine")


def test_inductors_own_default_is_not_taken_for_the_users_folder(tmp_path, monkeypatch, compile_settings):
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


def test_an_emulated_card_holds_this_processs_cuda_context_inside_its_cap(monkeypatch):
    """A 24 GiB card has 24 GiB for the CUDA context and the allocator together: the allocator is held to the cap
    less what the process holds outside it (an H200 whose allocator could fill all 24 let a run reach 24.6 GiB)."""
    import torch

    from lorakit.hardware import gpu

    got = {}
    total = 141 * 2**30
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": total}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: got.update(f=f, i=i))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (total - 2**29 - 3 * 2**30, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 0)
    monkeypatch.setattr(gpu, "_nvml_own", lambda i: None)  # another process holds 3 GiB: at most 1 counts as ours
    assert apply_cap("cuda") == 24.0 and got["f"] * total == pytest.approx(23 * 2**30)
    monkeypatch.setattr(gpu, "_nvml_own", lambda i: 2**29)  # NVML names this process's own: half a GiB
    apply_cap("cuda")
    assert got["f"] * total == pytest.approx(23.5 * 2**30)
    monkeypatch.delenv("LORAKIT_MEMORY_CAP_GIB")  # `bench step --memory-cap`, the peer races: the cap given
    assert apply_cap("cuda", 32) == 32 and got["f"] * total == pytest.approx(31.5 * 2**30)


def test_the_compile_cache_keeps_graphs_with_lorakits_autograd_functions(tmp_path, monkeypatch, compile_settings):
    """The graph of a block calling the attention's gradient-layout Function is one PyTorch's AOTAutograd cache
    leaves out by default (each run then traced its forward and backward again); once `compile_cache` has run,
    the same graph passes the cache's own check, in this thread, in a compile worker's thread (a copy of this
    one's context: torch's settings are per thread) and, through the environment, in the compile processes."""
    import contextvars
    import threading

    import torch
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

    from lorakit.hardware import sdpa
    from lorakit.hardware.gpu import CUSTOM_AUTOGRAD_ENV, compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile"))
    layout = sdpa._layout_grad_function()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, w):
        return layout.apply(x @ w).relu()

    torch._dynamo.reset()
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.compile(block, backend=keep, fullgraph=True)(x, w).sum().backward()
    assert len(graphs) == 1
    with pytest.raises(BypassAOTAutogradCache, match="autograd_function_apply"):
        check_cacheable(graphs[0])
    compile_cache()
    check_cacheable(graphs[0])
    assert os.environ[CUSTOM_AUTOGRAD_ENV] == "1"
    seen = {}

    def worker(to):
        seen[to] = compile_settings.autograd_cache_allow_custom_autograd_functions

    plain = threading.Thread(target=worker, args=("new thread",))
    copied = threading.Thread(target=contextvars.copy_context().run, args=(worker, "copied context"))
    for t in (plain, copied):
        t.start()
        t.join()
    assert seen == {"new thread": False, "copied context": True}  # how compile_bg starts its worker: the latter
    torch._dynamo.reset()


def test_the_compile_workers_are_inductors_own_pool_started_now(monkeypatch):
    """`compile_workers` starts torch's own worker pool (the compile process after its imports, a run whose step 1
    compiles in its own process before its caching: tests/unit/train/test_setup.py)."""
    import sys
    import types

    warmed = []
    fake = types.ModuleType("torch._inductor.async_compile")
    fake.maybe_warm_pool = lambda: warmed.append(1)
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    compile_workers()
    assert warmed == [1]
