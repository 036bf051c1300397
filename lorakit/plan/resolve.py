"""The one place a run's config is completed: layers merged (defaults < profile < YAML < --set), every path checked
once, then what this machine decides — the memory plan (which blocks recompute, the estimate checked against the
card), compile, CUDA graphs, the attention backend. `lorakit train --dry-run` prints the result; the run follows it
and writes the same config to config.resolved.yaml (a test holds the two equal)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.config import Config, assemble, check_paths
from lorakit.errors import ConfigError, LorakitError
from lorakit.events import Events
from lorakit.hardware import bytecode
from lorakit.hardware.attention import drop_all_early, drop_early, start_early
from lorakit.hardware.gpu import device_for
from lorakit.io import resolve_files
from lorakit.io.prefetch import Prefetch
from lorakit.models.base import trained_dir
from lorakit.models.sources import model_folder
from lorakit.plan.decide import (
    attention_backend,
    attention_can_wait,
    background_decision,
    compile_decision,
    compiled_recompute_decision,
    compute_decision,
    cpp_wrapper_decision,
    graphs_decision,
    has_fp8_units,
    has_repeated_blocks,
    lacks_room,
    step_line,
)
from lorakit.plan.memory import checkpointed, estimate, fit_to_gpu

PATHS = ("model", "data")  # what `train` and `cache` read; output and cache folders are always checked


@dataclass
class Resolved:
    """A run's final config and how it came to be."""

    cfg: Config
    profile: dict  # {"profile", "reason", "warnings"}
    device: str = "cpu"  # what the run computes on: "cuda" or "cpu"
    world: int = 1  # processes in the run
    estimate: dict | None = None  # the memory estimate the plan was checked with (GPU profiles)
    memory_note: str | None = None  # what the memory plan did (checkpointing turned on or off, and why)
    notes: list[str] = field(default_factory=list)  # settings the run cannot follow as asked, and why (warnings)
    attention_deferred: bool = False  # the first run here: attention is measured while the run starts (train/setup)
    attention_measured_s: float | None = None  # the first run here, measured inside the checks: how long it took
    step_inputs: dict | None = None  # for `step`: the attention asked for, what the machine could turn on
    read_ahead: Prefetch | None = None  # the transformer's files being read into the page cache (train/setup stops it)

    @property
    def step(self) -> str | None:
        """What the training step runs with, in one line (`plan.decide.step_line`), the attention as in force now
        (a measured one once the run has put it into `cfg`)."""
        return step_line(self.cfg, self.device, deferred=self.attention_deferred, **self.step_inputs) \
            if self.step_inputs else None

    def to_dict(self) -> dict:
        return {"profile": self.profile, "config": self.cfg.to_dict(), "device": self.device, "world": self.world,
                "memory_estimate": self.estimate, "memory_note": self.memory_note, "notes": list(self.notes),
                "attention_deferred": self.attention_deferred, "step": self.step}


def resolve(source: Path | dict | Config | None = None, overrides: list[str] | None = None,
            profile: str | None = None, *, paths: tuple[str, ...] = PATHS, train: bool = True,
            world: int | None = None, cap_gib: float | None = None, facts=None,
            events: Events | None = None, defer_attention: bool = False, read_ahead: bool = False,
            settled=None) -> Resolved:
    """The run's config, complete.

    Args:
        source: the user's YAML file, its contents (a dict), or a config already validated (its profile's
            defaults are then already in it).
        overrides: `key.path=value` strings (not with a validated config).
        profile: a profile name or "auto"; beats `profile:` in the YAML.
        paths: which of the config's inputs must exist ("model", "data"); the output and cache folders are
            always checked for writing.
        train: also decide what a training run decides (memory plan, compile, graphs, attention); `lorakit cache`
            needs none of it.
        world: processes in the run (default: the launcher's WORLD_SIZE, else 1).
        cap_gib: the GPU memory the run may use (default: LORAKIT_MEMORY_CAP_GIB, else the card's).
        facts: the hardware probe's facts for `auto` (probed when needed).
        events: where a long step of finding the model (a single file's one-time conversion) reports.
        defer_attention: a training run that may measure its attention backends while it starts (the first run
            of the family on this machine, where the card has room; the measurement's child processes start here,
            once the config is read, importing beside the checks: `attention.start_early`): `train.setup` begins it
            once the run is not refused, beside the encoders, the caching and the model's load, waits for it after
            the load and finishes the choice. A dry run measures here, before it returns.
        read_ahead: a training run: its transformer's files are read into the page cache from here on, beside the
            checks, the attention self-test and the encoding (`lorakit.io.prefetch`; one process per machine).
        settled: called with the config once its model folder and settings are known, before the plan imports a
            model library (the CLI leaves out of its process what the run does not use: `lorakit.unused`).

    Raises:
        ConfigError: every config and path problem at once; InputError: a run that cannot fit (with what would).
    """
    world = world or int(os.environ.get("WORLD_SIZE", "1") or 1)
    measures = defer_attention and train and world == 1
    try:  # a run refused here leaves no self-test children behind (a long-lived caller: tests, the UI)
        if isinstance(source, Config):
            cfg, prov = source, {"profile": source.profile, "reason": "a validated config", "warnings": []}
            if measures:  # a first run's self-test: its children import beside the checks
                self_test_children(cfg.model.family, cfg.profile, cfg.memory.attention)
        else:  # the children start from the user's layers, before the probe (`early_self_test`)
            cfg, prov = assemble(source, overrides, profile, facts, before_probe=early_self_test if measures else None)
        found = []
        if "model" in paths and cfg.model.path:  # a repo id, a single file: the folder the run loads
            folder, found = model_folder(cfg.model.path, cfg.model.base, cfg.model.family, events)
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": folder, "base": None})})
        check_paths(cfg, model="model" in paths, data="data" in paths)
        device = device_for(cfg.profile)
        out = Resolved(cfg, prov, device, world, notes=found)
        slow_imports = bytecode.note() if train else None  # every process of the run compiles the libraries again
        if slow_imports:
            out.notes.append(slow_imports)
        if read_ahead and cfg.model.path and int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            out.read_ahead = transformer_read_ahead(trained_dir(cfg))
        if settled:
            settled(cfg)
        if not train:
            return out
        out = plan_run(out, cap_gib, defer_attention)
        if not out.attention_deferred:  # measured already, or never here (a named backend, the CPU after all)
            drop_early(out.cfg.model.family)
        return out
    except BaseException:
        drop_all_early()
        raise


def early_self_test(layered: dict, profile: str) -> None:
    """A first run's attention self-test children started from the user's config, before the machine's probe
    imports torch (`config.assemble`): their own imports of torch and diffusers then overlap the probe's, where a
    small card's run waits for the measurement inside its checks. Qwen-Image, rtx4090 profile under a 24 GiB cap
    (a first run, one H200 each, 2026-12-01, `tools/race.py lorakit`): the checks took 27.6 s with the children
    started after the probe, 25.4 and 28.0 s started before it (two hosts whose steady steps differed by a third);
    `top` there: the children begin 4 s into the run instead of after the probe, and the run's thread then waits
    for their cases (about 3 s of bare shapes, then 9 s of the model case). Where the profile turns out to be the
    CPU's, or the plan measures nothing, `resolve` stops them again."""
    model, memory = layered.get("model"), layered.get("memory")
    family = model.get("family") if isinstance(model, dict) else None
    attention = memory.get("attention", "auto") if isinstance(memory, dict) else "auto"
    if isinstance(family, str):
        self_test_children(family, profile, attention)


def self_test_children(family: str, profile: str, attention: str) -> None:
    """Start the family's self-test children where the run will measure attention (`auto`, not the CPU)."""
    if profile != "cpu" and attention == "auto":
        start_early(family, "cuda")


def transformer_read_ahead(folder: Path) -> Prefetch | None:
    """The trained transformer's weight files read ahead (None where the folder has none: the load names the
    problem)."""
    try:
        files = resolve_files(folder)
    except (OSError, LorakitError):  # the load reports them
        return None
    return Prefetch(files) if files else None


def plan_run(r: Resolved, cap_gib: float | None = None, defer_attention: bool = False) -> Resolved:
    """Fill in a training run's machine decisions (see `resolve`)."""
    cfg, device, notes = r.cfg, r.device, r.notes
    m = cfg.memory
    blocks = estimate(cfg, r.world)["blocks"]
    if m.blocks_to_swap >= blocks:
        raise ConfigError([f"memory.blocks_to_swap={m.blocks_to_swap}: the {cfg.model.family} transformer has "
                           f"{blocks} blocks (swap at most {blocks - 1})"],
                          hint="the memory check names the count that fits: leave blocks_to_swap at 0 and run "
                               "`lorakit train CONFIG --dry-run`")
    if device == "cpu" and m.blocks_to_swap:
        notes.append(f"memory.blocks_to_swap={m.blocks_to_swap} keeps blocks in host memory to save GPU memory; "
                     "this run is on the CPU, so it is 0")
        cfg = cfg.model_copy(update={"memory": m.model_copy(update={"blocks_to_swap": 0})})
    cfg, est, r.memory_note = fit_to_gpu(cfg, cap_gib, world=r.world)  # refuses a run that cannot fit
    m = cfg.memory
    sharded = cfg.method == "full" and r.world > 1
    compiled, why = compile_decision(cfg, device, m.blocks_to_swap or None,
                                     device.startswith("cuda") and m.compile and has_repeated_blocks(cfg.model.family))
    recomputed = blocks if m.blocks_to_swap else checkpointed(cfg, blocks)
    together = compiled_recompute_decision(cfg, device, compiled, recomputed, False, sharded)[0]
    graphs, graphs_why = graphs_decision(cfg, device, compiled, recomputed, sharded, together)
    background, bg_why = background_decision(cfg, compiled, graphs, est, est and est.get("budget_gib"), sharded)
    compute, compute_why = compute_decision(cfg, device)
    cpp, cpp_why = cpp_wrapper_decision(cfg, device, compiled, graphs, background)
    notes += [n for n in (why, graphs_why, bg_why, compute_why, cpp_why) if n]
    room = lacks_room(cfg, est, est and est.get("budget_gib")) is None
    r.attention_deferred = defer_attention and attention_can_wait(cfg, device, r.world, room)
    attention = "auto" if r.attention_deferred else attention_backend(
        cfg, device, notes.append, measured=lambda s: setattr(r, "attention_measured_s", s))
    cpp_attention = attention if cpp else None  # the C++ wrapper recomputes only lorakit's cuDNN operators
    in_graph, in_graph_why = compiled_recompute_decision(cfg, device, compiled, recomputed, background, sharded,
                                                         cpp_attention)
    notes += [in_graph_why] if in_graph_why else []
    r.cfg = cfg.model_copy(update={"memory": m.model_copy(update={"compile": compiled, "cuda_graphs": graphs,
                                                                  "compile_background": background,
                                                                  "compiled_recompute": in_graph,
                                                                  "cpp_wrapper": cpp,
                                                                  "attention": attention, "compute": compute})})
    r.estimate = est
    could_graph = not m.cuda_graphs and graphs_decision(
        cfg.model_copy(update={"memory": m.model_copy(update={"cuda_graphs": True})}), device, compiled, recomputed,
        sharded, together)[0]
    could_fp8 = compute == "bf16" and cfg.method == "lora" and has_fp8_units(device)
    could_compile_recompute = m.compiled_recompute is False and compiled_recompute_decision(
        cfg.model_copy(update={"memory": m.model_copy(update={"compiled_recompute": True})}), device, compiled,
        recomputed, background, sharded, cpp_attention)[0]
    r.step_inputs = {"asked_attention": m.attention, "graphs_possible": could_graph, "fp8_possible": could_fp8,
                     "recompute_possible": could_compile_recompute}
    return r
