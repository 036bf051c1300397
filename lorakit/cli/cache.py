"""`lorakit cache CONFIG`."""

from __future__ import annotations

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
    resolve_config,
    use_json,
)

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
    log_format: str = LogFormatOpt,
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    # config and path errors are reported now, before anything else (--check reads the datasets only)
    if not check:
        from lorakit.quiet import quiet_libraries

        quiet_libraries(imports=False)  # before anything imports them (bitsandbytes speaks at import)
        _build(config, sets, profile, force, verify, strict, as_json, log_format)
        return
    cfg = resolve_config(config, sets, profile, paths=("data",), train=False).cfg
    from lorakit.data.check import check as check_data

    report = check_data(cfg)
    if not (as_json and strict and report["problems"]):  # with --json, one document: the refusal holds them all
        emit(as_json, report, lambda: _render(report))
    if strict and report["problems"]:
        from lorakit.data.check import strict_refusal

        raise strict_refusal(report["problems"], "fix the files listed above, or drop --strict to skip those items")


def _build(config: Path, sets, profile, force: bool, verify: bool, strict: bool, as_json: bool,
           log_format: str) -> None:
    import functools

    from lorakit.cache.builder import build
    from lorakit.cli.logs import events_for, finish
    from lorakit.quiet import quiet_libraries

    with events_for(log_format, as_json, console, err_console, label="caching") as events:
        # a single-file model is converted here, once: the log says so
        resolved = resolve_config(config, sets, profile, train=False, events=events,
                                  settled=functools.partial(leave_out_unused, training=False))
        quiet_libraries()  # the rest of it, with the libraries caching imports
        for note in resolved.notes:
            events.info(note)
        summary = build(resolved.cfg, resolved.device, force=force, verify=verify, strict=strict, events=events)
    finish(events, as_json, summary.to_dict(), lambda: _render_summary(summary))


def _render_summary(s) -> None:
    what = f"{s.items} windows of {s.clips} clips" if s.clips else f"{s.items} items"
    console.print(f"[bold]cache[/] {s.cache_dir}: {what} ({s.encoded} encoded, {s.reused} reused"
                  f"{f', {s.pruned} stale removed' if s.pruned else ''}), {s.bytes / 2**20:.1f} MiB, {s.seconds:.1f} s")
    if s.buckets:
        console.print("buckets: " + ", ".join(f"{b} x{n}" for b, n in s.buckets.items()))
    if s.verified_bad:
        console.print(f"[yellow]--verify:[/] {len(s.verified_bad)} damaged entries were re-encoded")
    if s.skipped:
        console.print(f"[yellow]skipped {len(s.skipped)} item(s):[/]")
        for p in s.skipped:
            console.print(f"  - {p['path']}: {p['code']}: {p['message']}", markup=False, soft_wrap=True)


def _render(report: dict) -> None:
    from rich.table import Table

    t = Table(title=f"datasets for {report['family']}", title_justify="left")
    t.add_column("folder", overflow="fold")
    video = any(d["layout"] == "video" for d in report["datasets"])
    for c in ("layout", "items", *(("windows",) if video else ()), "problems"):
        t.add_column(c)
    for d in report["datasets"]:
        t.add_row(d["dir"], d["layout"] + (f" ({', '.join(d['controls'])})" if d["controls"] else ""),
                  str(d["items"]), *((str(d["entries"]),) if video else ()), str(d["problems"]))
    console.print(t)
    if report["problems"]:
        roots = [d["dir"] for d in report["datasets"]]
        where = f" (paths in {roots[0]})" if len(roots) == 1 else ""
        p = Table(title=f"problems (these items or windows are skipped){where}", title_justify="left")
        p.add_column("file", overflow="fold")
        p.add_column("problem", no_wrap=True)
        p.add_column("detail")
        for pr in report["problems"]:
            path = pr["path"]
            if len(roots) == 1 and path.startswith(roots[0].rstrip("/") + "/"):
                path = path[len(roots[0].rstrip("/")) + 1:]
            p.add_row(path, pr["code"], pr["message"])
        console.print(p)
    if report["buckets"]:
        what = "buckets (width x height x frames)" if video else "buckets"
        console.print(f"{what}: " + ", ".join(f"{b} x{n}" for b, n in report["buckets"].items()))
    for w in report.get("warnings", []):
        console.print("[yellow]warning:[/] " + w.replace("[", r"\["), soft_wrap=True)
    ready = f"{report['items']} clips, {report['entries']} windows ready" if video else f"{report['items']} items ready"
    console.print(f"{ready}, {len(report['problems'])} problems")
