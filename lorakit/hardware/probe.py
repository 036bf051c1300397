"""Facts about this machine. No side effects beyond reading (no kernels launched, nothing written).

`probe()` returns a `Facts`; tests build `Facts` by hand (`Facts.from_dict`) to stand for other
machines (a DGX Spark, an RTX 4090, a 12 GB card, ...).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorakit.paths import cache_root, write_whole

# GPUs whose memory is shared with (or coherent with) the CPU. `is_integrated` catches
# integrated parts; these names cover the coherent Grace superchips that report as discrete.
_UNIFIED_NAME_HINTS = ("GB10", "GH200", "GB200", "GB300", "Thor")


@dataclass
class GpuFacts:
    index: int
    name: str
    capability: tuple[int, int]
    total_gib: float
    free_gib: float | None = None
    integrated: bool = False
    unified: bool = False
    multiprocessors: int | None = None

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        return self.capability >= (8, 9)


@dataclass
class Facts:
    os: str = ""
    arch: str = ""
    cpu_count: int = 0
    ram_gib: float = 0.0
    disk_free_gib: float | None = None
    disk_path: str = "."
    python: str = ""
    torch: str | None = None
    torch_cuda: str | None = None  # CUDA runtime torch was built with
    cudnn: str | None = None
    driver: str | None = None
    torch_arch_list: list[str] = field(default_factory=list)
    gpus: list[GpuFacts] = field(default_factory=list)
    gds: bool = False
    gds_reason: str = ""
    packages: dict[str, str | None] = field(default_factory=dict)  # name -> version or None
    fastsafetensors_gpu: bool | None = None  # can fastsafetensors reach the GPU runtime
    env: dict[str, str] = field(default_factory=dict)
    cached: bool = False  # the torch-side facts came from this machine's earlier probe (`probe(use_cache=True)`)

    @property
    def gpu(self) -> GpuFacts | None:
        return self.gpus[0] if self.gpus else None

    def to_dict(self) -> dict:
        d = asdict(self)
        for g, gd in zip(self.gpus, d["gpus"], strict=True):
            gd.update(sm=g.sm, bf16=g.bf16, tf32=g.tf32, fp8=g.fp8, code=code_support(self, g))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Facts:
        d = dict(d)
        gpus = []
        for g in d.pop("gpus", []):
            g = {k: v for k, v in g.items() if k in GpuFacts.__dataclass_fields__}
            g["capability"] = tuple(g["capability"])
            gpus.append(GpuFacts(**g))
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(gpus=gpus, **known)


def code_support(facts: Facts, gpu: GpuFacts) -> dict:
    """Does the installed torch carry code for this GPU?

    Returns:
        {"kind": "exact" | "compatible" | "ptx" | "none" | "unknown", "detail": str}
        - exact: SASS for this sm; compatible: SASS of the same major, lower minor (sm_120 runs on sm_121);
        - ptx: only PTX the driver must JIT (slow first start, sometimes missing features); none: no code.
    """
    arches = facts.torch_arch_list
    if not arches:
        return {"kind": "unknown", "detail": "torch reported no architecture list"}
    major, minor = gpu.capability
    sass = {}
    ptx = []
    for a in arches:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", a)
        if not m:
            continue
        cap = (int(m.group(2)), int(m.group(3)))
        if m.group(1) == "sm":
            sass[cap] = a
        else:
            ptx.append(cap)
    if (major, minor) in sass:
        return {"kind": "exact", "detail": f"torch has {sass[(major, minor)]} code"}
    same_major = sorted(c for c in sass if c[0] == major and c[1] < minor)
    if same_major:
        c = same_major[-1]
        return {"kind": "compatible",
                "detail": f"torch has sm_{c[0]}{c[1]} code, which runs on sm_{major}{minor} (same major)"}
    usable_ptx = sorted(c for c in ptx if c <= (major, minor))
    if usable_ptx:
        c = usable_ptx[-1]
        return {"kind": "ptx", "detail": f"only compute_{c[0]}{c[1]} PTX: the driver JIT-compiles it at start"}
    top = max(sass) if sass else None
    upto = f" (code only up to sm_{top[0]}{top[1]})" if top else ""
    return {"kind": "none", "detail": f"torch has no code for sm_{major}{minor}{upto}"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ram_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def _driver_version() -> str | None:
    p = Path("/proc/driver/nvidia/version")
    if p.is_file():
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", p.read_text(errors="replace"))
        if m:
            return m.group(1)
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            line = out.stdout.strip().splitlines()
            return line[0].strip() if out.returncode == 0 and line else None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _gds() -> tuple[bool, str]:
    if not Path("/proc/driver/nvidia-fs").exists():
        return False, "the nvidia-fs kernel module is not loaded (GPUDirect Storage unavailable)"
    return True, "nvidia-fs loaded"


PACKAGES = ("diffusers", "transformers", "peft", "accelerate", "safetensors", "fastsafetensors",
            "optimum-quanto", "bitsandbytes", "flash-attn", "flash_attn_3", "flash-attn-4", "xformers", "torchvision",
            "prodigyopt", "tensorboard")


def machine_key() -> dict | None:
    """What the probe's torch-side answer depends on, read without importing torch: package versions, the
    NVIDIA driver and the GPUs it lists (/proc/driver/nvidia), the device-selection environment. None where
    the GPUs cannot be listed that way (no NVIDIA Linux driver): there the probe is never cached."""
    gpus = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    version = Path("/proc/driver/nvidia/version")
    try:
        if not gpus or not version.is_file():
            return None
        return {"key": 1, "python": platform.python_version(), "arch": platform.machine(),
                "packages": {n: _version(n) for n in ("torch", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13", *PACKAGES)}, "driver": version.read_text(),
                "gpus": [g.read_text() for g in gpus],
                "env": {k: v for k, v in os.environ.items() if k.endswith("VISIBLE_DEVICES")
                        or k.startswith(("CUDA_", "PYTORCH_"))}}
    except OSError:
        return None


def facts_cached() -> bool:
    """Would `probe(use_cache=True)` answer without importing torch?"""
    key = machine_key()
    return key is not None and _facts_file(key).is_file()


def _facts_file(key: dict) -> Path:
    import hashlib
    import json

    return cache_root() / "machine" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
                                       + ".json")


def probe(disk_path: str | os.PathLike = ".", use_cache: bool = False) -> Facts:
    """Read this machine's facts (imports torch).

    `use_cache`: answer the torch-side facts (torch build, GPUs, code support) from this machine's last probe
    when `machine_key` is unchanged, without importing torch (4 s on an H100 host); disk, RAM, packages and
    environment are read fresh. GPU free memory is then the earlier reading.
    """
    import json

    key = machine_key()
    if use_cache and key is not None:
        try:
            f = Facts.from_dict(json.loads(_facts_file(key).read_text()))
            fresh = _probe_host(disk_path)
            for name in ("cpu_count", "ram_gib", "disk_free_gib", "disk_path", "packages", "env"):
                setattr(f, name, getattr(fresh, name))
            f.cached = True
            return f
        except (OSError, ValueError, TypeError, KeyError):
            pass  # absent or damaged: probe
    f = _probe(disk_path)
    if key is not None:
        text = json.dumps(f.to_dict())
        write_whole(_facts_file(key), lambda tmp: tmp.write_text(text))  # an unwritable cache only costs a probe
    return f


def _probe_host(disk_path) -> Facts:
    f = Facts(os=platform.system(), arch=platform.machine(), cpu_count=os.cpu_count() or 0,
              ram_gib=round(_ram_gib(), 1), python=platform.python_version(), disk_path=str(disk_path))
    try:
        f.disk_free_gib = round(shutil.disk_usage(disk_path).free / 2**30, 1)
    except OSError:
        f.disk_free_gib = None
    f.packages = {name: _version(name) for name in PACKAGES}
    f.env = {k: v for k, v in os.environ.items()
             if k.startswith(("CUDA_", "PYTORCH_", "NCCL_", "LORAKIT_")) or k in ("HF_HOME",)}
    return f


def _probe(disk_path) -> Facts:
    f = _probe_host(disk_path)
    try:
        import torch
    except ImportError:
        return f
    f.torch = torch.__version__
    f.torch_cuda = torch.version.cuda
    if torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()
        f.cudnn = f"{v // 10000}.{(v // 100) % 100}.{v % 100}" if v and v >= 10000 else str(v)
    if torch.cuda.is_available():
        f.driver = _driver_version()
        f.torch_arch_list = list(torch.cuda.get_arch_list())
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            try:
                free, _ = torch.cuda.mem_get_info(i)
                free_gib = round(free / 2**30, 1)
            except RuntimeError:
                free_gib = None
            integrated = bool(getattr(p, "is_integrated", False))
            unified = integrated or any(h in p.name for h in _UNIFIED_NAME_HINTS)
            f.gpus.append(GpuFacts(index=i, name=p.name, capability=(p.major, p.minor),
                                   total_gib=round(p.total_memory / 2**30, 1), free_gib=free_gib,
                                   integrated=integrated, unified=unified,
                                   multiprocessors=p.multi_processor_count))
        f.gds, f.gds_reason = _gds()
    if f.packages.get("fastsafetensors"):
        f.fastsafetensors_gpu = _fastsafetensors_gpu()
    return f


def _fastsafetensors_gpu() -> bool | None:
    """Can fastsafetensors load the GPU runtime (libcudart) the way its loader does?"""
    try:
        from fastsafetensors.common import is_gpu_found
        from fastsafetensors.copier.nogds import load_library_func
        from fastsafetensors.frameworks import get_framework_op
    except Exception:  # noqa: BLE001 - a broken install is a fact, not a crash
        return None
    try:
        load_library_func(get_framework_op("pytorch"))  # dlopens the runtime, as a load would
        return bool(is_gpu_found())
    except Exception:  # noqa: BLE001 - it raises when the runtime is missing
        return False
