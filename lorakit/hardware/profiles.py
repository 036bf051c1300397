"""Hardware profiles: load the YAML data, pick one for a machine, say why, warn on mismatches."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lorakit.errors import FileFormatError, UnknownNameError
from lorakit.hardware.probe import probe

ORDER = ("dgx-spark", "rtx4090", "rtx5090", "datacenter", "cpu")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    hardware: dict
    defaults: dict


@dataclass
class Choice:
    profile: Profile
    reason: str
    warnings: list[str] = field(default_factory=list)


def _profile_files() -> dict[str, Any]:
    try:  # installed: the top-level profiles/ ships as the package lorakit.profiles
        root = resources.files("lorakit.profiles")
    except ModuleNotFoundError:  # running from a source checkout that is not installed
        root = Path(__file__).resolve().parents[2] / "profiles"
    return {p.name[:-5]: p for p in root.iterdir() if p.name.endswith(".yaml")}


def profile_names() -> list[str]:
    """Valid profile names (the known order first, then any extra files)."""
    names = list(_profile_files())
    return [n for n in ORDER if n in names] + sorted(n for n in names if n not in ORDER)


def load_profile(name: str) -> Profile:
    """Read one profile.

    Raises:
        UnknownNameError: no such profile (with the valid names).
        FileFormatError: the YAML is malformed.
    """
    files = _profile_files()
    if name not in files:
        raise UnknownNameError("profile", name, ["auto", *profile_names()])
    try:
        data = yaml.safe_load(files[name].read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise FileFormatError(f"profile {name}: YAML error: {e}") from None
    missing = [k for k in ("description", "hardware", "defaults") if k not in data]
    if missing:
        raise FileFormatError(f"profile {name}: missing {', '.join(missing)}")
    return Profile(name=name, description=data["description"], hardware=data["hardware"], defaults=data["defaults"])


def _gib(x: float) -> str:
    return f"{x:.0f} GiB"


def auto_select(facts) -> tuple[str, str]:
    """The profile name for a machine, and one sentence saying why."""
    gpu = facts.gpu
    if gpu is None:
        return "cpu", "no CUDA GPU was found, so lorakit runs tiny models on the CPU"
    desc = f"{gpu.name} ({gpu.sm}, {_gib(gpu.total_gib)})"
    if gpu.unified:
        return "dgx-spark", f"{desc} shares its memory with the CPU (unified memory), like a DGX Spark"
    if gpu.total_gib >= 70:
        return "datacenter", f"{desc} has 70 GiB or more: bf16 base, no quantization"
    if gpu.total_gib >= 30:
        return "rtx5090", f"{desc} has 30-70 GiB: fp8 base with gradient checkpointing"
    return "rtx4090", f"{desc} has under 30 GiB: 8-bit base, 8-bit optimizer and checkpointing"


def fit_warnings(profile: Profile, facts) -> list[str]:
    """Ways a profile does not fit the detected hardware (empty when it fits)."""
    hw = profile.hardware
    gpu = facts.gpu
    out = []
    if hw.get("gpu") and gpu is None:
        out.append(f"profile {profile.name} needs a CUDA GPU and none was found: use --profile cpu")
        return out
    if gpu is None:
        return out
    if hw.get("unified") and not gpu.unified:
        out.append(f"profile {profile.name} is for unified memory, but {gpu.name} is a discrete GPU: "
                   f"pinned-memory and offload settings will be wrong (try --profile auto)")
    if not hw.get("unified") and gpu.unified and profile.name != "cpu":
        out.append(f"{gpu.name} shares memory with the CPU: profile {profile.name} pins and offloads memory "
                   f"it does not need to (try --profile dgx-spark)")
    need = float(hw.get("min_memory_gib") or 0)
    if need and gpu.total_gib < need:
        out.append(f"profile {profile.name} expects at least {_gib(need)} of GPU memory, {gpu.name} has "
                   f"{_gib(gpu.total_gib)}: expect out-of-memory at 1024² (lower data.resolution, raise "
                   f"memory.blocks_to_swap)")
    if not hw.get("gpu") and gpu is not None:
        out.append(f"profile cpu ignores the GPU {gpu.name}")
    return out


def choose(name: str = "auto", facts=None) -> Choice:
    """Resolve a profile name (or "auto") for a machine.

    Args:
        name: "auto" or a profile name.
        facts: `probe.Facts`; probed when None.
    """
    if name != "auto" and name not in profile_names():
        raise UnknownNameError("profile", name, ["auto", *profile_names()])
    if facts is None:
        facts = probe()
    if name == "auto":
        picked, reason = auto_select(facts)
    else:
        picked, reason = name, "chosen with --profile / the config's profile key"
    profile = load_profile(picked)
    return Choice(profile=profile, reason=reason, warnings=fit_warnings(profile, facts))
