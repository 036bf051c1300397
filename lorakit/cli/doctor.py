"""`lorakit doctor`: is this machine ready, which profile, which attention kernels really work."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, console, emit, use_json

HELP = """Check this machine: GPU, driver, torch code for the GPU, cuDNN, loaders, quantization, attention.

Prints one line per check (✓ ok, ⚠ warning, ✗ failure) with a fix hint, the recommended profile
and the attention backend each family will use. --json is what a bug report should paste.
Exit code 1 when a required check fails."""

_MARK = {"ok": "[green]✓[/]", "warn": "[yellow]⚠[/]", "fail": "[red]✗[/]", "info": "[blue]·[/]"}


def doctor(
    profile: str | None = ProfileOpt,
    quick: bool = typer.Option(False, "--quick", help="skip the attention self-test and the library trials"),
    retest: bool = typer.Option(False, "--retest", help="re-run the attention self-test (ignore the cache)"),
    disk: Path = typer.Option(Path("."), "--disk", help="where outputs go (free space is checked there)"),
    from_file: Path | None = typer.Option(None, "--from", help="re-read a `doctor --json` report (e.g. "
                                             "from a bug report) instead of probing this machine"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    from lorakit.hardware import doctor as doc
    from lorakit.hardware.attention import AttentionReport
    from lorakit.hardware.attention import choose as choose_attention
    from lorakit.hardware.probe import Facts, probe
    from lorakit.hardware.profiles import choose

    attention = None
    if from_file is not None:
        saved = _read_report(from_file)
        facts = Facts.from_dict(saved["facts"])
        if saved.get("attention"):
            attention = AttentionReport.from_dict(saved["attention"])
            attention.choice = {f: choose_attention(attention, f) for f in attention.choice}
        quick = True
    else:
        facts = probe(disk)
    choice = choose(profile or "auto", facts)
    if not quick and facts.gpus:
        from lorakit.hardware.attention import self_test

        with console.status("attention self-test (forward + backward of each SDPA backend)...") \
                if not as_json else _null():
            attention = self_test("cuda", use_cache=not retest)
    libs = None
    if not quick:
        from lorakit.hardware.libs import CHECKS, run_check

        device = "cuda" if facts.gpus else "cpu"
        with console.status("trying optimum-quanto and bitsandbytes on this device...") if not as_json else _null():
            libs = {n: run_check(n, device) for n in CHECKS if facts.packages.get(n)}
    results = doc.checks(facts, choice, attention, libs)
    counts = doc.summary(results)
    data = {"summary": counts, "profile": {"name": choice.profile.name, "reason": choice.reason,
                                           "warnings": choice.warnings},
            "checks": doc.to_dicts(results), "facts": facts.to_dict(),
            "attention": attention.to_dict() if attention else None}
    emit(as_json, data, lambda: _render(results, choice, attention, facts, from_file))
    if counts["fail"]:
        raise typer.Exit(1)


def _read_report(path: Path) -> dict:
    import json

    from lorakit.errors import InputError

    try:
        data = json.loads(Path(path).read_text())
        assert isinstance(data, dict) and isinstance(data["facts"], dict)
        return data
    except (OSError, ValueError, AssertionError, KeyError) as e:
        raise InputError(f"--from {path}: not a `lorakit doctor --json` report ({type(e).__name__})",
                         "produce one with: lorakit doctor --json > report.json") from None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _render(results, choice, attention, facts, from_file=None) -> None:
    from rich.table import Table

    t = Table(title="lorakit doctor", show_lines=False, title_justify="left")
    t.add_column("", width=1)
    t.add_column("check", style="bold")
    t.add_column("result")
    t.add_column("what to do", style="dim")
    for c in results:
        t.add_row(_MARK[c.status], c.name, c.detail, c.hint)
    console.print(t)
    console.print(f"[bold]profile:[/] {choice.profile.name} — {choice.reason}")
    for w in choice.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    if attention is not None:
        pretty = ", ".join(f"{f}={b or 'none'}" for f, b in attention.choice.items())
        cached = " (cached result; --retest to measure again)" if attention.cached else ""
        if from_file is not None:
            cached = f" (measurements from {from_file}, choice by this lorakit)"
        console.print(f"[bold]attention:[/] {pretty}{cached}")
    elif not facts.gpus:
        console.print("[bold]attention:[/] CPU - PyTorch's SDPA (math / CPU flash); no GPU self-test needed")
    fails = sum(c.status == "fail" for c in results)
    warns = sum(c.status == "warn" for c in results)
    console.print(f"{'[red]not ready[/]' if fails else '[green]ready[/]'}: {fails} failed, {warns} warnings")
