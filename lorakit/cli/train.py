"""`lorakit train CONFIG`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, SetOpt, emit, print_resolved, resolve_config, use_json

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
    from lorakit.train import run

    result = run(cfg, prov, resume=resume, as_json=as_json)
    emit(as_json, result)
