"""`lorakit train CONFIG`."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from lorakit.cli.common import (
    JsonOpt,
    LogFormatOpt,
    ProfileOpt,
    SetOpt,
    console,
    emit,
    err_console,
    leave_out_unused,
    print_resolved,
    resolve_config,
    use_json,
)
from lorakit.cli.experts import expert_phases
from lorakit.dist import from_slurm

HELP = """Train a LoRA (or, with method: full, every weight) from a config (YAML).

The config merges, lowest first: built-in defaults < hardware profile < CONFIG < --set.
--dry-run prints the resolved config (after checking it and every path in it) and stops before any weights load.
Ctrl-C or SIGTERM saves a checkpoint and exits with code 75 (interrupted, resumable: --resume latest).
--gpus N runs N processes on this machine (data parallel for LoRA, FSDP for method: full); the same run
starts with `accelerate launch --multi_gpu --num_processes N -m lorakit train CONFIG` or `torchrun`."""


def train(
    config: Path = typer.Argument(..., help="run config (YAML)", show_default=False),
    sets: list[str] | None = SetOpt,
    profile: str | None = ProfileOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and stop"),
    resume: str | None = typer.Option(None, "--resume", help="latest (the newest intact checkpoint), auto "
                                 "(the same, or a fresh start when there is none: one command for a scheduler's first "
                                 "start and its requeues), or a checkpoint folder"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="processes on this machine, one per GPU (on a machine "
                                                       "without GPUs: CPU processes over gloo)"),
    force: bool = typer.Option(False, "--force", help="start over in an output.dir that holds an earlier run (its "
                                                      "metrics, checkpoints, samples and LoRA are removed first; "
                                                      "without it such a run is refused)"),
    log_format: str = LogFormatOpt,
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    from_slurm()  # `srun lorakit train`: one process per task, its rank and peers from SLURM's variables
    launching = gpus > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1
    phases = expert_phases(config, sets, resume)  # model.expert both: one run per expert, high then low
    if phases:
        return _train_experts(phases, profile, dry_run, launching, gpus, config, as_json, log_format, force)
    if dry_run or launching:  # the config and every path are checked first; launched processes resolve their own
        resolved = resolve_config(config, sets, profile, world=gpus if launching else None, train=dry_run)
        room = _check_start(resolved.cfg, resume, force)  # what the run itself refuses, refused before it launches
        if room:  # a full fine-tune: what its checkpoints will take on the output folder's disk
            resolved.notes.append(room)
        if dry_run:
            emit(as_json, resolved.to_dict(), lambda: print_resolved(resolved))
            return
        raise typer.Exit(_launch(gpus, config, sets, profile, resume, as_json, log_format, force))
    rank = int(os.environ.get("RANK", "0") or 0)
    events = _events(rank, log_format, as_json)
    with events:
        resolved, result = _run_one(config, sets, profile, resume, events, force)
    _finish(rank, resolved, result, events, as_json)


def _events(rank: int, log_format: str, as_json: bool):
    from lorakit.cli.logs import events_for
    from lorakit.events import Events
    from lorakit.quiet import quiet_libraries

    quiet_libraries(imports=False)  # before anything imports them (bitsandbytes speaks at import)
    return Events() if rank else events_for(log_format, as_json, console, err_console)


def _run_one(config: Path, sets, profile, resume, events, force: bool):
    """Resolve the config (timed as a phase of the log) and train it; (resolved, the run's result)."""
    from lorakit.quiet import quiet_libraries
    from lorakit.train.loop import run

    # the first run on a machine measures its attention backends here, or while it starts where the card has room
    # (train/setup; once, cached): the log says so
    with events.phase("check config and machine") as facts:
        resolved = resolve_config(config, sets, profile, events=events, defer_attention=True, read_ahead=True,
                                  settled=_settled)
        facts.update(check_facts(resolved))
    quiet_libraries()  # the rest of it, with the libraries this run imports
    return resolved, run(resolved, resume=resume, events=events, force=force)


def check_facts(resolved) -> dict:
    """What the checks' line says: the profile and the attention backend — to be measured while the run starts,
    or chosen, and how long of the checks its measurement took where it ran inside them (the first run of the
    family on this machine, on a card without room for it beside the loading)."""
    attention, measured = resolved.cfg.memory.attention, resolved.attention_measured_s
    if resolved.attention_deferred:
        attention = "measured while the run starts"
    elif measured:
        attention += (f", measured in {measured:.1f} s of this check: the first run of {resolved.cfg.model.family} "
                      "here, kept for the next")
    return {"profile": resolved.cfg.profile, "attention": attention}


def _settled(cfg) -> None:
    """Once the config is read: what the run does not use left out of the process, then a first run's compile
    processes started (their imports beside the checks: `train.precompile.start_early`)."""
    from lorakit.hardware.gpu import device_for
    from lorakit.train import precompile

    leave_out_unused(cfg)
    precompile.start_early(cfg, device_for(cfg.profile), int(os.environ.get("WORLD_SIZE", "1") or 1))


def _finish(rank: int, resolved, result: dict, events, as_json: bool) -> None:
    from lorakit.cli.logs import finish

    if rank:
        raise typer.Exit(_exit_code(result))
    if resolved.cfg.output.hub_repo and not result["interrupted"]:
        result["hub"] = _share(resolved.cfg, events)
    finish(events, as_json, result, lambda: _render(result))
    if result["interrupted"]:  # a scheduler must not see success: the run can be resumed
        raise typer.Exit(_exit_code(result))


def _train_experts(phases, profile, dry_run: bool, launching: bool, gpus: int, config: Path, as_json: bool,
                   log_format: str, force: bool) -> None:
    """model.expert both: the high-noise expert's run, then the low-noise one's (`cli/experts.py`)."""
    if dry_run or launching:
        shown = {}
        for ph in phases:
            shown[ph.expert] = r = resolve_config(config, ph.sets, profile, world=gpus if launching else None,
                                                  train=dry_run)
            if not ph.skip:
                _check_start(r.cfg, ph.resume, force)
        if dry_run:
            def show():
                for e, r in shown.items():
                    console.print(f"[bold]model.expert both — the {e}-noise expert's run:[/]")
                    print_resolved(r)
            emit(as_json, {"experts": {e: r.to_dict() for e, r in shown.items()}}, show)
            return
        for ph in phases:
            rc = 0 if ph.skip else _launch(gpus, config, ph.sets, profile, ph.resume, as_json, log_format, force)
            if rc:
                raise typer.Exit(rc)
        return
    rank = int(os.environ.get("RANK", "0") or 0)
    events = _events(rank, log_format, as_json)
    results: dict[str, dict] = {}
    with events:
        for ph in phases:
            if ph.skip:
                events.info(f"model.expert both: the {ph.expert}-noise expert's run finished before ({ph.out} "
                            f"holds {ph.skip}); not trained again")
                results[ph.expert] = {"skipped": ph.skip, "dir": str(ph.out), "lora": str(ph.lora)}
                continue
            events.info(f"model.expert both: the {ph.expert}-noise expert, into {ph.out}")
            _, results[ph.expert] = _run_one(config, ph.sets, profile, ph.resume, events, force)
            if results[ph.expert]["interrupted"]:
                break  # --resume latest continues this expert, then trains the other
    result = {"experts": results, "interrupted": any(r.get("interrupted") for r in results.values()),
              "loras": {e: r["lora"] for e, r in results.items() if r.get("lora")}}
    if rank:
        raise typer.Exit(_exit_code(result))
    _finish_experts(events, as_json, result, phases[0].model)
    if result["interrupted"]:
        raise typer.Exit(_exit_code(result))


def _exit_code(result: dict) -> int:
    """75 for an interrupted (resumable) run, else 0. A rank started by `lorakit train --gpus N` ends with 0 either
    way (torch's elastic agent stops the other ranks when one fails), rank 0 leaving the result for the launching
    command, which gives the 75 (`dist.run_launched`)."""
    import json

    from lorakit.dist import launched_result
    from lorakit.errors import EXIT_INTERRUPTED_RESUMABLE

    where = launched_result()
    if where:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            Path(where).write_text(json.dumps({"interrupted": bool(result["interrupted"])}))
        return 0
    return EXIT_INTERRUPTED_RESUMABLE if result["interrupted"] else 0


def _finish_experts(events, as_json: bool, result: dict, model: str) -> None:
    """Both experts' results: each run's lines, then the command that samples with both LoRAs."""
    import time

    from lorakit.cli import STARTED
    from lorakit.cli.logs import finish

    def show():
        for e, r in result["experts"].items():
            console.print(f"[bold]the {e}-noise expert:[/]" + (f" not trained again ({r['skipped']})"
                                                               if r.get("skipped") else ""))
            if not r.get("skipped"):
                _render(r, since_start=False)
        console.print(f"both experts: {time.monotonic() - STARTED:.1f} s since the command began")
        if len(result["loras"]) == 2:
            loras = " ".join(f"--lora {p}" for p in result["loras"].values())
            console.print(f"sample with both: lorakit infer {model} -p PROMPT {loras}")

    finish(events, as_json, result, show)


def _share(cfg, events) -> dict:
    """output.hub_repo: the finished run pushed (a failed upload is said; the run's result stands)."""
    from lorakit.errors import LorakitError
    from lorakit.hub import push

    o = cfg.output
    if cfg.method != "lora":
        events.warn(f"output.hub_repo: a method={cfg.method} run is not pushed (lorakit push shares LoRA runs)")
        return {"repo": o.hub_repo, "uploaded": False, "error": "not a LoRA run"}
    try:
        got = push(o.dir, o.hub_repo, license=o.hub_license, private=o.hub_private)
    except LorakitError as e:
        events.warn(f"output.hub_repo: {e.message} ({e.hint})")
        return {"repo": o.hub_repo, "uploaded": False, "error": e.message}
    for w in got["warnings"]:
        events.warn(f"output.hub_repo: {w}")
    events.info(f"output.hub_repo: {got['url']}" if got["uploaded"] else f"output.hub_repo: {got['folder']} "
                f"written; {got['how']}")
    return got


def _check_start(cfg, resume: str | None, force: bool) -> str | None:
    """The checks a run makes of its output folder and checkpoint before anything loads, for --dry-run and the
    launcher: an earlier run's results (refused without --resume or --force), the checkpoint --resume names, the
    disk room a full fine-tune's checkpoints need (returned: what they take, said; None for a LoRA run)."""
    from lorakit.io.lock import refuse_held
    from lorakit.plan import disk
    from lorakit.train import checkpoint
    from lorakit.train.resume import check_fresh_start, find

    out = Path(cfg.output.dir)
    refuse_held(out, "training run", "wait for it to finish, or give this run another output.dir")  # as the run does
    check_fresh_start(out, cfg.output.name, resume, force)
    if resume:
        find(out, resume, cfg.method == "full", checkpoint.latest)
    room = disk.check(cfg, out)
    return disk.said(room, out) if room else None


def _launch(gpus: int, config: Path, sets, profile, resume, as_json: bool, log_format: str, force: bool) -> int:
    """Run this command again in `gpus` processes (torch's elastic launcher) and wait for them."""
    from lorakit.dist import launch_command, run_launched

    args = [str(config)]
    for s in sets or []:
        args += ["--set", s]
    if profile:
        args += ["--profile", profile]
    if resume:
        args += ["--resume", resume]
    if force:
        args.append("--force")
    if as_json:
        args.append("--json")
    if log_format != "auto":
        args += ["--log-format", log_format]
    if not as_json:
        console.print(f"launching {gpus} processes: {' '.join(launch_command(gpus, args)[2:])}")
    return run_launched(launch_command(gpus, args))


def _render(r: dict, since_start: bool = True) -> None:
    """One run's result; `since_start`: say the time since the command began (one expert of two: its own time)."""
    import time

    from lorakit.cli import STARTED

    state = ("interrupted (exit code 75): resumable with --resume latest" if r["interrupted"] else "done")
    took = (f"{time.monotonic() - STARTED:.1f} s since the command began ({r['seconds']:.1f} s of them training, "
            f"samples and checkpoints)" if since_start else f"{r['seconds']:.1f} s training, samples and checkpoints")
    console.print(f"[bold]{state}[/] after {r['steps']} steps: {took}")
    memory = gpu_memory_line(r)
    if memory:
        console.print(memory)
    if r.get("lora"):
        # diffusers loads a low-noise expert's LoRA into the pipeline's second transformer only when told
        how = "pipe.load_lora_weights(path, load_into_transformer_2=True)" if r.get("expert") == "low" else \
            "pipe.load_lora_weights(path)"
        console.print(f"LoRA: {r['lora']}  (diffusers: {how})")
    if r.get("transformer"):
        console.print(f"transformer: {r['transformer']}  (diffusers component folder)")
    if r.get("early_stopped"):
        console.print(f"stopped early at step {r['early_stopped']['at_step']}: {r['early_stopped']['why']}")
    if r.get("best"):
        b = r["best"]
        console.print(f"best: step {b['step']} ({b['why']}) -> {b['checkpoint']}"
                      + (f", samples {b['samples']}" if b.get("samples") else ""))
    if r.get("loss_curve"):
        console.print(f"loss curve: {r['loss_curve']}")
    console.print(f"checkpoint: {r['checkpoint']}\nmetrics: {r['metrics']}")


def gpu_memory_line(r: dict) -> str | None:
    """The run's GPU memory peak beside the plan's estimate (each process's peak in a run of several); None on
    the CPU."""
    peaks = [x.get("peak_gpu_gib") for x in r.get("per_rank") or [r]]
    if any(p is None for p in peaks):
        return None
    est = (r.get("memory_estimate") or {}).get("gib")
    planned = f" (planned {est:.1f} GiB{' each' if len(peaks) > 1 else ''})" if est is not None else ""
    if len(peaks) == 1:
        return f"GPU memory: {peaks[0]:.1f} GiB at peak{planned}"
    return f"GPU memory per process: {', '.join(f'{p:.1f}' for p in peaks)} GiB at peak{planned}"
