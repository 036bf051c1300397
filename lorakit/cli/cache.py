"""`lorakit cache CONFIG`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, SetOpt, resolve_config, use_json
from lorakit.cli.pending import not_in_this_build

HELP = """Encode a dataset once: text embeddings and VAE latents into a content-addressed store.

--check only validates the dataset and lists every problem; --verify checks stored files;
--force rebuilds everything."""


def cache(
    config: Path = typer.Argument(..., help="run config (YAML)", show_default=False),
    sets: list[str] | None = SetOpt,
    profile: str | None = ProfileOpt,
    check: bool = typer.Option(False, "--check", help="validate the dataset only"),
    strict: bool = typer.Option(False, "--strict", help="fail on any bad item instead of skipping it"),
    verify: bool = typer.Option(False, "--verify", help="check every stored file"),
    force: bool = typer.Option(False, "--force", help="rebuild every entry"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    resolve_config(config, sets, profile)  # config errors are reported now, before anything else
    raise not_in_this_build("`lorakit cache`", 5, "`lorakit train CONFIG --dry-run` validates the config")
