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
    retest: bool = typer.Option(False, "--retest", help="measure again: the machine probe, the attention self-test "
                                                       "and the library trials (ignore their cached results)"),
    disk: Path = typer.Option(Path("."), "--disk", help="where outputs go (free space is checked there)"),
    from_file: Path | None = typer.Option(None, "--from", help="re-read a `doctor --json` report (e.g. "
                                             "from a bug report) instead of probing this machine"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    import time

    t0 = time.perf_counter()
    out = _Lines(not as_json)
    out.first("lorakit doctor: probing this machine...")  # before torch is imported: the first line is instant
    from lorakit.hardware import doctor as doc
    from lorakit.hardware.attention_cases import AttentionReport
    from lorakit.hardware.attention_choice import choose as choose_attention
    from lorakit.hardware.probe import Facts, probe
    from lorakit.hardware.profiles import choose

    attention = None
    timings = {}
    early = _prestart(quick or from_file is not None, retest)
    try:
        if from_file is not None:
            saved = _read_report(from_file)
            facts = Facts.from_dict(saved["facts"])
            if saved.get("attention"):
                attention = AttentionReport.from_dict(saved["attention"])
                attention.choice = {f: choose_attention(attention, f) for f in attention.choice}
            quick = True
        else:
            facts = probe(disk, use_cache=not retest)
        timings["probe_s"] = round(time.perf_counter() - t0, 2)
        if facts.cached and from_file is None:
            out.note("machine facts: this machine's earlier probe (same driver, GPUs and packages; --retest probes "
                     "again)")
        choice = choose(profile or "auto", facts)
        results: list = []

        def add(c) -> None:
            results.append(c)
            out.check(c)

        ok = doc.base_checks(facts, add)
        if ok and from_file is None:  # this Python's own (a report read back has no such fact)
            doc.bytecode_check(add)
        if ok and not quick:
            libs, attention = _measure(facts, retest, out, timings, early)
        else:
            libs = None
    finally:
        _stop(early)
    if ok:
        doc.quant_checks(facts, add, libs or {})
        doc.profile_check(choice, add)
        if attention is not None:
            doc.attention_checks(attention, add)
    counts = doc.summary(results)
    timings["total_s"] = round(time.perf_counter() - t0, 2)
    data = {"summary": counts, "profile": {"name": choice.profile.name, "reason": choice.reason,
                                           "warnings": choice.warnings},
            "checks": doc.to_dicts(results), "facts": facts.to_dict(),
            "attention": attention.to_dict() if attention else None, "timings": timings}
    emit(as_json, data, lambda: _render(counts, choice, attention, facts, from_file, timings))
    if counts["fail"]:
        raise typer.Exit(1)


def _prestart(quick: bool, retest: bool) -> dict | None:
    """On a GPU machine whose probe is not cached yet (a first doctor, or --retest), start the children of
    the library trials and the attention self-test before the probe imports torch: their own imports (4 s
    each on an H100 host) then overlap it. They wait for their jobs; unused ones are stopped."""
    from lorakit.hardware.probe import facts_cached, machine_key

    if quick or machine_key() is None or (facts_cached() and not retest):
        return None
    from lorakit.hardware import attention, libs
    from lorakit.hardware.probe import _version

    return {"libs": {n: libs.spawn(n) for n in libs.CHECKS if _version(n)}, "attention": attention.prestart()}


def _stop(early: dict | None) -> None:
    if not early:
        return
    from lorakit.hardware import attention, libs

    libs._stop(early.get("libs", {}))
    attention.close_children(early.get("attention"))


def _measure(facts, retest: bool, out, timings: dict, early: dict | None):
    """The library trials and the attention self-test, at the same time (each runs in its own children);
    each result line is printed as it arrives. Both are cached per machine."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from lorakit.hardware.libs import CHECKS, run_checks

    device = "cuda" if facts.gpus else "cpu"
    names = [n for n in CHECKS if facts.packages.get(n)]

    def libs():
        t = time.perf_counter()
        r = run_checks(names, device, facts, use_cache=not retest,
                       progress=lambda x: out.note(f"{x.name} trial: {'works' if x.ok else 'fails'}"),
                       children=(early or {}).pop("libs", None))
        timings["libs_s"] = round(time.perf_counter() - t, 2)
        return r

    def attention():
        if not facts.gpus:
            return None
        from lorakit.hardware.attention import self_test

        t = time.perf_counter()
        r = self_test("cuda", use_cache=not retest, progress=_AttentionProgress(out), facts=facts,
                      children=(early or {}).pop("attention", None))
        timings["attention_s"] = round(time.perf_counter() - t, 2)
        if r.cached:
            out.note("attention: cached result for this machine (--retest measures again)")
        return r

    with ThreadPoolExecutor(max_workers=2) as ex:
        fl, fa = ex.submit(libs), ex.submit(attention)
        return fl.result(), fa.result()


class _AttentionProgress:
    """One line per SDPA backend once its bare shapes are done, and one per in-model case."""

    def __init__(self, out):
        self.out = out
        self.seen: dict[str, list] = {}

    def __call__(self, r) -> None:
        from lorakit.hardware.attention_cases import all_cases, all_model_cases

        if r.case in all_model_cases():
            state = f"ok ({r.ms:.1f} ms)" if r.ok else f"fails: {r.error}"
            self.out.note(f"sdpa {r.backend} inside the {r.case} transformer: {state}")
            return
        rs = self.seen.setdefault(r.backend, [])
        rs.append(r)
        if len(rs) == len(all_cases()):
            bad = [x.case for x in rs if not x.ok]
            self.out.note(f"sdpa {r.backend}: {len(rs) - len(bad)}/{len(rs)} shapes pass forward+backward"
                          + (f" (fails: {', '.join(bad)})" if bad else ""))


class _Lines:
    """doctor's output as it happens: one line per check (mark, name, result, what to do)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        import threading

        self.lock = threading.Lock()

    def first(self, text: str) -> None:
        if self.enabled:
            console.print(f"[bold]{text}[/]")

    def check(self, c) -> None:
        if not self.enabled:
            return
        from rich.markup import escape

        hint = f"  [dim]→ {escape(c.hint)}[/]" if c.hint else ""
        with self.lock:
            console.print(f"{_MARK[c.status]} [bold]{escape(c.name):<22}[/] {escape(c.detail)}{hint}",
                          soft_wrap=True, highlight=False)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        from rich.markup import escape

        with self.lock:
            console.print(f"  [dim]… {escape(text)}[/]", soft_wrap=True, highlight=False)


def _read_report(path: Path) -> dict:
    import json

    from lorakit.errors import InputError

    why = None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        data, why = None, type(e).__name__
    if why is None and not (isinstance(data, dict) and isinstance(data.get("facts"), dict)):
        why = "no facts"
    if why:
        raise InputError(f"--from {path}: not a `lorakit doctor --json` report ({why})",
                         "produce one with: lorakit doctor --json > report.json")
    return data


def _render(counts, choice, attention, facts, from_file=None, timings=None) -> None:
    """What follows the check lines: the profile, the attention choice, the verdict."""
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
    took = f" ({timings['total_s']:.1f} s)" if timings and from_file is None else ""
    console.print(f"{'[red]not ready[/]' if counts['fail'] else '[green]ready[/]'}: {counts['fail']} failed, "
                  f"{counts['warn']} warnings{took}")
