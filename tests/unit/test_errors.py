from lorakit.errors import ConfigError, InputError, LorakitError, UnknownNameError


def test_exit_codes_bad_input_is_2_failure_is_1():
    assert InputError("x").exit_code == 2
    assert ConfigError(["a: b"]).exit_code == 2
    assert LorakitError("x").exit_code == 1


def test_config_error_names_every_problem():
    e = ConfigError(["lora.rnk: unknown key", "optim.lr: must be > 0, got -1"], source="run.yaml")
    assert "run.yaml" in e.message and "lora.rnk" in e.message and "optim.lr" in e.message
    assert e.to_dict()["problems"] == e.problems


def test_unknown_name_suggests_closest():
    e = UnknownNameError("profile", "rtx4909", ["rtx4090", "rtx5090", "cpu"])
    assert "rtx4909" in e.message
    assert e.hint.startswith("did you mean 'rtx4090'?")


def torch_oom(asked, total, free, mine, allocated, reserved, other=None) -> str:
    """PyTorch's out-of-memory message as its CUDA allocator writes it (c10/cuda: the sizes as it formats them)."""
    return (f"CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of {total} of which {free} "
            f"is free. {f'Process 4711 has {other} memory in use. ' if other else ''}Including non-PyTorch memory, "
            f"this process has {mine} memory in use. Of the allocated memory {allocated} is allocated by PyTorch, "
            f"and {reserved} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting ...")


def test_out_of_gpu_memory_says_what_was_asked_held_and_capped(monkeypatch):
    """torch's figures are the whole GPU's: under an emulated cap its "53.79 GiB is free" misled (H100, session
    22); the message keeps what was asked and held, and names the cap."""
    from lorakit.errors import environment_fault

    text = torch_oom("384.00 MiB", "79.18 GiB", "53.79 GiB", "24.00 GiB", "22.91 GiB", "612.35 MiB", other="612.00 MiB")
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    f = environment_fault(RuntimeError(text))
    assert f.message == ("out of GPU memory: asked for 384.00 MiB, 22.91 GiB allocated by PyTorch, 612.35 MiB "
                         "reserved but unallocated (this process held to 24 GiB by LORAKIT_MEMORY_CAP_GIB)")
    monkeypatch.delenv("LORAKIT_MEMORY_CAP_GIB")
    assert environment_fault(RuntimeError(text)).message.endswith("reserved but unallocated")
    assert environment_fault(RuntimeError("CUDA out of memory (odd build)")).message == \
        "out of GPU memory: CUDA out of memory (odd build)"


def test_out_of_gpu_memory_held_in_pieces_names_expandable_segments(monkeypatch):
    """Qwen-Image, 840 modules, 24 GiB, expandable segments off: out of memory with 2.37 GiB reserved but unallocated
    (H100, 2026-11-26); with them on it trains at 22.2 GiB. The hint says so where they are off."""
    from lorakit.errors import environment_fault

    text = ("CUDA out of memory. Tried to allocate 96.00 MiB. ... Of the allocated memory 21.54 GiB is allocated by "
            "PyTorch, and 2.37 GiB is reserved by PyTorch but unallocated. If reserved but unallocated ...")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    hint = environment_fault(RuntimeError(text)).hint
    assert hint.startswith("2.37 GiB were held in pieces too small to use: --set memory.expandable_segments=true")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert environment_fault(RuntimeError(text)).hint.startswith("is another process using the GPU")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    small = text.replace("2.37 GiB is reserved", "612.35 MiB is reserved")
    assert environment_fault(RuntimeError(small)).hint.startswith("is another process using the GPU")


def test_out_of_gpu_memory_on_a_gpu_other_processes_filled_says_how_much_they_hold(monkeypatch):
    """One H100, 2026-11-26, four cells at once: the 24 GiB cell ran out with 17.76 GiB allocated — below its cap,
    because the GPU itself was full. Torch's message says how much is free and how much this process holds; the
    rest is other processes'. Under a cap with room on the GPU (free above what was asked) nothing is said of them."""
    from lorakit.errors import environment_fault, others_gib

    text = torch_oom("676.00 MiB", "79.19 GiB", "0 bytes", "18.31 GiB", "17.76 GiB", "54.46 MiB", other="50.10 GiB")
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    f = environment_fault(RuntimeError(text))
    assert f.message == ("out of GPU memory: asked for 676.00 MiB, 17.76 GiB allocated by PyTorch, 54.46 MiB reserved "
                         "but unallocated (this process held to 24 GiB by LORAKIT_MEMORY_CAP_GIB); the GPU itself was "
                         "full: other processes held 60.9 GiB of it")
    assert f.hint.startswith("other processes hold 60.9 GiB of this GPU (nvidia-smi lists them): stop them or choose "
                             "another GPU (CUDA_VISIBLE_DEVICES). For training: ")
    capped = text.replace("of which 0 bytes is free", "of which 55.20 GiB is free")  # the cap, not the GPU
    assert others_gib(capped) is None and environment_fault(RuntimeError(capped)).hint.startswith("is another process")
    assert others_gib(text.replace("79.19 GiB of which", "18.80 GiB of which")) is None  # this process alone
