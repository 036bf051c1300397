"""`lorakit train CONFIG`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import (
    JsonOpt,
    ProfileOpt,
    SetOpt,
    console,
    emit,
    print_resolved,
    resolve_config,
    use_json,
)

HELP = """Train a LoRA from a config (YAML).

The config merges, lowest first: built-in defaults < hardware profile < CONFIG < --set.
--dry-run prints the resolved config and stops before any weights load."""


def train(
    config: Path = typer.Argument(..., help="run config (YAML)", show_default=False),
    sets: list[str] | None = SetOpt,
    profile: str | None = ProfileOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and stop"),
    resume: str | None = typer.Option(None, "--resume", help="latest or a checkpoint folder"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    cfg, prov = resolve_config(config, sets, profile)
    if dry_run:
        emit(as_json, {"profile": prov, "config": cfg.to_dict()}, lambda: print_resolved(cfg, prov))
        return
    from lorakit.quiet import quiet_libraries
    from lorakit.train.loop import run

    quiet_libraries()
    if as_json:
        result = run(cfg, prov, resume=resume)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                      TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task("train", total=cfg.schedule.steps, info="caching")

            def progress(step, total, rec):
                info = f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['s_per_step']:.2f} s/step"
                if "gpu_gib" in rec:
                    info += f"  {rec['gpu_gib']:.1f} GiB"
                bar.update(task, completed=step, info=info)

            result = run(cfg, prov, resume=resume, progress=progress)
    emit(as_json, result, lambda: _render(result))


def _render(r: dict) -> None:
    state = "interrupted: resume with --resume latest" if r["interrupted"] else "done"
    console.print(f"[bold]{state}[/] after {r['steps']} steps, {r['seconds']:.1f} s")
    if r.get("lora"):
        console.print(f"LoRA: {r['lora']}  (diffusers format: pipe.load_lora_weights(path))")
        console.print(f"loss curve: {r['loss_curve']}")
    console.print(f"checkpoint: {r['checkpoint']}\nmetrics: {r['metrics']}")
