"""`model.expert: both` (Wan 2.2 A14B): `lorakit train` trains the high-noise expert, then the low-noise one.

Each expert denoises its own part of the trajectory (sigmas at or above the boundary, or below it), so a LoRA for
one never sees the other's steps: two runs one after the other train what one run switching between the experts
would, with one expert's memory at a time. Each run writes output.dir/<expert> (its LoRA file, checkpoints,
samples, metrics); both read the one cache (the experts share the latents and text)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import InputError

EXPERTS = ("high", "low")  # the order trained: the high-noise steps come first at sampling time


@dataclass
class Phase:
    """One expert's run: its `--set` lines, its folder, its --resume, and why it is not run (finished before)."""

    expert: str
    sets: list[str]
    out: Path
    resume: str | None
    lora: Path
    model: str
    skip: str | None = None


def expert_phases(config: Path, sets: list[str] | None, resume: str | None) -> list[Phase] | None:
    """The two runs of a `model.expert: both` config (None for any other config: it trains as it is). With
    --resume latest or auto, an expert whose run finished is not trained again and the other continues (or
    starts); without it, each run refuses a folder holding an earlier run as any run does (--force starts over).

    Raises:
        InputError: output.hub_repo (two LoRA files: each folder is pushed with `lorakit push`); --resume naming a
            checkpoint folder (each expert's run has its own).
    """
    from lorakit.config.loading import deep_merge, load_yaml, parse_overrides
    from lorakit.train.resume import earlier_run

    over, problems = parse_overrides(sets or [])
    layered = deep_merge(load_yaml(config), over)

    def section(key: str) -> dict:
        v = layered.get(key)
        return v if isinstance(v, dict) else {}

    if problems or section("model").get("expert") != "both":
        return None  # the config's own checks report its problems
    output = section("output")
    if output.get("hub_repo"):
        raise InputError("output.hub_repo: model.expert both makes two LoRA files, one per expert",
                         "leave output.hub_repo out and push each expert's folder: lorakit push OUTPUT/high REPO")
    if resume not in (None, "latest", "auto"):
        raise InputError(f"--resume {resume}: with model.expert both, each expert's run has its own checkpoints",
                         "--resume latest (or auto) continues each expert where it stopped")
    out = Path(output.get("dir") or "output")
    name = str(output.get("name") or "lora")
    cache = section("data").get("cache_dir") or out / "cache"
    phases = []
    for e in EXPERTS:
        folder = out / e
        found = earlier_run(folder, name) if resume else None
        done = found if found and found.startswith("a finished run") else None
        phases.append(Phase(e, [*(sets or []), f"model.expert={e}", f"output.dir={folder}", f"data.cache_dir={cache}"],
                            folder, None if resume is None or done else "auto", folder / f"{name}.safetensors",
                            str(section("model").get("path") or "MODEL"), done))
    return phases
