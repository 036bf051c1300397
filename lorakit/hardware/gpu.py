"""The GPU a process computes on, and the settings that hold for the whole process: the device (the GPU unless the
profile is `cpu` or none is visible), an emulated smaller card (LORAKIT_MEMORY_CAP_GIB), the allocator's
expandable segments."""

from __future__ import annotations

import os

from lorakit.errors import InputError
from lorakit.paths import cache_root


def device_for(profile: str) -> str:
    """"cuda" or "cpu": what a run with this profile computes on here."""
    if profile == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


CAP_ENV = "LORAKIT_MEMORY_CAP_GIB"


def env_cap_gib() -> float | None:
    """LORAKIT_MEMORY_CAP_GIB: emulate a smaller card (e.g. 24 for an RTX 4090 on an H100) in every command."""
    raw = os.environ.get(CAP_ENV, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = None
    if v is None or not v > 0 or v == float("inf"):
        raise InputError(f"{CAP_ENV}={raw!r}: give the GiB a process may use, e.g. 24")
    return v


def apply_cap(device: str, cap: float | None = None) -> float | None:
    """Hold this process to `cap` GiB (default LORAKIT_MEMORY_CAP_GIB) of the GPU as a card that small would:
    PyTorch's allocator refuses past the cap less what the process holds outside it (its CUDA context and loaded
    kernels, measured here, once the context exists). On the card itself that memory is taken from the same total:
    a 24 GiB cap whose allocator could fill all 24 let a run reach 24.6 GiB of the GPU (NVML; Qwen-Image, rtx4090
    profile, one H200, 2026-11-29) that no 24 GiB card has. Returns the cap, or None."""
    cap = cap or env_cap_gib()
    if not cap or not str(device).startswith("cuda"):
        return None
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    room = cap * 2**30 - outside_allocator(index)
    torch.cuda.set_per_process_memory_fraction(min(max(room, 0) / total, 1.0), index)
    return cap


CONTEXT_MAX = 2**30  # where NVML cannot tell this process's own use: at most this of the device's counts as ours


def outside_allocator(index: int) -> int:
    """Bytes of GPU `index` this process holds outside PyTorch's allocator (creating its CUDA context if there is
    none yet): NVML's figure for this process where NVML lists it, else the device's used memory less what the
    allocator holds, at most `CONTEXT_MAX` (other processes' memory is not this card's)."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    held = torch.cuda.memory_reserved(index)
    own = _nvml_own(index)
    if own is None:
        return min(max(total - free - held, 0), CONTEXT_MAX)
    return max(own - held, 0)


def _nvml_own(index: int) -> int | None:
    """This process's GPU memory on `index` as NVML lists it (None: no NVML, or this process not seen by it, as
    in a container with its own process ids)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()  # NVML counts the machine's GPUs, torch those CUDA_VISIBLE_DEVICES leaves: torch maps them
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(index))
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return int(p.usedGpuMemory)
    except Exception:  # noqa: BLE001 - NVML absent or refusing: the device-wide figure stands
        return None
    return None


def expandable_segments() -> None:
    """memory.expandable_segments: the CUDA allocator grows segments instead of caching fixed blocks (less
    fragmentation; the dgx-spark profile's unified memory wants it). Set before the first allocation."""
    import torch

    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            x for x in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True") if x)
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # older torch: the environment variable (read at CUDA start) holds
        pass


def run_environment(memory, device: str) -> None:
    """What a training run puts in its process's environment before anything allocates or compiles, which the
    processes it starts inherit: the allocator's expandable segments (memory.expandable_segments) and the compile
    cache (memory.compile). On the CPU, nothing."""
    if not device.startswith("cuda"):
        return
    if memory.expandable_segments:
        expandable_segments()
    if memory.compile:
        compile_cache()  # compiled blocks reused by the next run


def compile_cache_dir() -> str:
    """Where torch.compile's artefacts are kept: an explicit TORCHINDUCTOR_CACHE_DIR, else lorakit's cache
    (Inductor's own default in that variable is not the user's: see `compile_cache`)."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) == _inductor_default():
        given = None
    return given or str(cache_root() / "compile")


def compile_cache() -> str:
    """torch.compile's artefacts (Inductor's FX graphs and Triton kernels) kept in lorakit's cache, so a later run
    on this machine reuses them (its blocks compile in seconds) also where /tmp is cleared between jobs; an
    explicit TORCHINDUCTOR_CACHE_DIR is kept. Inductor writes its own default (/tmp/torchinductor_<user>) into
    TORCHINDUCTOR_CACHE_DIR the first time anything asks it for its folder; that value is not the user's and is
    replaced (on an H100, 2026-11-27, a run's graphs went there, past lorakit's cache). Returns the folder."""
    folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
    os.makedirs(folder, exist_ok=True)
    cache_custom_autograd()
    return folder


def compile_workers() -> None:
    """Start Inductor's compile worker processes now; torch starts them at its first compile otherwise, and its
    first kernels then wait for their imports (torch's, in a process of their own). A compile process does it once
    its own imports are done (`train.rehearse`); a run whose step 1 compiles in its own process, before its caching
    (`train.setup`): the workers' imports then run beside the caching and the model's load."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # another torch: they start at the first compile
        return
    maybe_warm_pool()


CUSTOM_AUTOGRAD_ENV = "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD"


def cache_custom_autograd() -> None:
    """Let the compile cache keep the graphs whose blocks call lorakit's autograd Functions: the attention's
    gradient layout (`hardware.sdpa`), fp8 compute and 8-bit bases (`train.quant`). PyTorch's AOTAutograd cache
    leaves out any graph with a custom autograd Function unless told (its key hashes the traced forward and
    backward, which decide what the graph does); left out, every run traces each graph's forward and backward
    again and only Inductor's part comes from the cache (FLUX.1-dev 1024², cuDNN attention, a first run's 4 graphs
    taken from the cache between two steps, one H200, 2026-11-30: 11.2 s; kept whole, 4.6 s). For this process and,
    through the environment, the compile processes it starts (`train.precompile`)."""
    try:  # torch's settings hold for the thread that makes them (compile_bg's worker runs in a copy of its context)
        import torch._functorch.config as functorch_config
    except ImportError:
        return
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    os.environ[CUSTOM_AUTOGRAD_ENV] = "1"  # read as torch is imported: a child process's setting, in every thread


def _inductor_default() -> str | None:
    """The folder Inductor falls back to (None where this torch does not say)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def budget_gib(device: str) -> float:
    """The memory this process may use on `device`: LORAKIT_MEMORY_CAP_GIB, else the card's total."""
    cap = env_cap_gib()
    if cap:
        return float(cap)
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory / 2**30
