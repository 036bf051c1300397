"""How a command's progress reads where it goes: a terminal gets a progress bar naming the current phase; a log file or
a scheduler (stdout not a terminal: nohup, SLURM) gets one plain line per phase with its duration and a step line at
least every 10 s and at every tenth of the run, never cut to a terminal's width; `--log-format json` gives the same
as JSON lines. The s/step shown is the average of the last 20 steps, not the last one."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections import deque

from lorakit.cli import STARTED
from lorakit.events import Events

FORMATS = ("auto", "rich", "plain", "json")
EVERY_S = 10.0  # a step line at least this often
WINDOW = 20  # steps in the s/step average


def _duration(s: float) -> str:
    s = max(int(round(s)), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _facts(facts: dict) -> str:
    shown = []
    for k, v in facts.items():
        if v is None or v is False or v == [] or v == "":
            continue
        if v is True:
            shown.append(k.replace("_", " "))
            continue
        if k == "gib":
            shown.append(f"{v} GiB")
        elif k == "gb_per_s":
            shown.append(f"{v} GB/s")
        else:
            shown.append(f"{k.replace('_', ' ')} {v}")
    return f" ({', '.join(shown)})" if shown else ""


class StepPace:
    """When a step line is due, and the average pace. The run's first step record (step 1, or the first after a
    resume) is its own figure: its time holds the one-time work before it (compiling the blocks, the first
    allocations; 47 s of a FLUX step 1 under the rtx4090 profile, H100 2026-11-27), so it is said as the first
    step's time and kept out of the pace and the ETA; every later interval counts, stalls included."""

    def __init__(self, every_s: float = EVERY_S, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.window: deque = deque(maxlen=WINDOW)
        self.last = -math.inf
        self.decile = None
        self.first: float | None = None

    def add(self, step: int, total: int, s_per_step: float) -> bool:
        """Record a step; True when its line is due (the first, the last, a new tenth of the run, or 10 s on)."""
        if self.first is None:
            self.first = s_per_step
        else:
            self.window.append(s_per_step)
        decile = step * 10 // max(total, 1)
        now = self.clock()
        due = step == 1 or step >= total or decile != self.decile or now - self.last >= self.every_s
        if due:
            self.last, self.decile = now, decile
        return due

    @property
    def avg(self) -> float | None:
        """The mean of the last WINDOW intervals after the first step (None before the second)."""
        return sum(self.window) / len(self.window) if self.window else None

    def pace_text(self) -> str:
        avg = self.avg
        return f"first step {self.first or 0.0:.2f} s" if avg is None else f"{avg:.2f} s/step"


class LineEvents(Events):
    """Plain lines (or JSON lines) on a stream, flushed as they are written. A phase that runs longer than `every_s`
    says so every `every_s` while it runs ("load model... 20 s"), so a log is never silent for long."""

    def __init__(self, stream=None, as_json: bool = False, every_s: float = EVERY_S, clock=time.monotonic):
        self.stream, self.as_json, self.clock, self.every_s = stream or sys.stdout, as_json, clock, every_s
        self.t0 = STARTED if clock is time.monotonic else clock()  # seconds since the command began
        self.pace = StepPace(every_s, clock)
        self.counted: dict[str, float] = {}
        self.lock = threading.Lock()
        self.open: dict[str, float] = {}  # phases running, by name: when they began
        self.ticker: threading.Thread | None = None
        self.closed = threading.Event()

    def __exit__(self, *exc) -> bool:
        self.closed.set()
        return False

    def _write(self, text: str, record: dict) -> None:
        t = self.clock() - self.t0
        line = json.dumps({"t": round(t, 2), **record}, default=str) if self.as_json else f"[{t:7.1f} s] {text}"
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def phase_start(self, name: str) -> None:
        with self.lock:
            self.open[name] = self.clock()
            if self.ticker is None:
                self.ticker = threading.Thread(target=self._tick, name="lorakit-log", daemon=True)
                self.ticker.start()

    def _tick(self) -> None:
        """While a phase runs, a line every `every_s` naming it and how long it has run."""
        said: dict[str, float] = {}
        while not self.closed.wait(min(max(self.every_s, 0.05), 1.0)):  # never a busy loop (every_s 0: every step)
            now = self.clock()
            with self.lock:
                running = list(self.open.items())
            for name, began in running:
                if now - said.get(name, began) >= self.every_s:
                    said[name] = now
                    self._write(f"{name}... {now - began:.0f} s", {"event": "phase_running", "name": name,
                                                                  "seconds": round(now - began, 1)})

    def phase_failed(self, name: str) -> None:
        with self.lock:
            self.open.pop(name, None)

    def phase_end(self, name: str, seconds: float, facts: dict) -> None:
        self.phase_failed(name)
        self._write(f"{name}: {seconds:.1f} s{_facts(facts)}", {"event": "phase", "name": name,
                                                              "seconds": round(seconds, 2), **facts})

    def progress(self, what: str, done: int, total: int, detail: str = "") -> None:
        now = self.clock()
        if done in (0, total) or now - self.counted.get(what, -math.inf) >= EVERY_S:
            self.counted[what] = now
            self._write(f"{what} {done}/{total}" + (f" ({detail})" if detail else ""),
                        {"event": "progress", "what": what, "done": done, "total": total, "detail": detail})

    def step(self, step: int, total: int, rec: dict) -> None:
        if not self.pace.add(step, total, rec.get("s_per_step", 0.0)):
            return
        avg = self.pace.avg
        eta = None if avg is None else (total - step) * avg
        text = f"step {step}/{total}  loss {rec['loss']:.4f}  lr {rec['lr']:.1e}  {self.pace.pace_text()}"
        if eta is not None:
            text += f"  eta {_duration(eta)}"
        if rec.get("gpu_gib") is not None:
            text += f"  {rec['gpu_gib']:.1f} GiB"
        if rec.get("val_loss") is not None:
            text += f"  val_loss {rec['val_loss']:.4f}"
        self._write(text, {"event": "step", **rec, "s_per_step_avg": None if avg is None else round(avg, 4),
                           "eta_s": None if eta is None else round(eta, 1), "total": total})

    def info(self, msg: str) -> None:
        self._write(msg, {"event": "info", "message": msg})

    def result(self, data: dict) -> None:
        """The command's result, the last JSON line (--log-format json without --json)."""
        self._write("", {"event": "result", **data})

    def warn(self, msg: str) -> None:
        self._write(f"warning: {msg}", {"event": "warning", "message": msg})


class TerminalEvents(Events):
    """A rich progress bar naming the current phase; finished phases, notes and warnings printed above it."""

    def __init__(self, console, total: int | None = None, label: str = "training"):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeRemainingColumn(), console=console, transient=False)
        self.task = self.bar.add_task(label, total=total, info="starting")
        self.pace = StepPace()
        self.said = ""  # the last step's figures, shown again when a phase ends

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.bar.stop()
        return False

    def phase_start(self, name: str) -> None:
        self.bar.update(self.task, info=f"{name}...")

    def phase_end(self, name: str, seconds: float, facts: dict) -> None:
        from rich.markup import escape

        self.console.print(f"[dim]{escape(name)}: {seconds:.1f} s{escape(_facts(facts))}[/]", soft_wrap=True)
        self.bar.update(self.task, info=self.said)

    def progress(self, what: str, done: int, total: int, detail: str = "") -> None:
        self.bar.update(self.task, info=f"{what} {done}/{total} {detail}".rstrip())

    def step(self, step: int, total: int, rec: dict) -> None:
        self.pace.add(step, total, rec.get("s_per_step", 0.0))
        info = f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {self.pace.pace_text()}"
        if rec.get("gpu_gib") is not None:
            info += f"  {rec['gpu_gib']:.1f} GiB"
        self.said = info
        self.bar.update(self.task, completed=step, total=total, info=info)

    def info(self, msg: str) -> None:
        from rich.markup import escape

        self.console.print(escape(msg), soft_wrap=True)

    def warn(self, msg: str) -> None:
        from rich.markup import escape

        self.console.print(f"[yellow]warning:[/] {escape(msg)}", soft_wrap=True)


def finish(events, as_json: bool, data: dict, render) -> None:
    """The command's result: JSON (--json), the last JSON line (--log-format json), or `render` for people."""
    from lorakit.cli.common import emit

    if isinstance(events, LineEvents) and events.as_json and not as_json:
        events.result(data)
    else:
        emit(as_json, data, render)


def events_for(log_format: str, as_json: bool, console, err_console, total: int | None = None,
               label: str = "training"):
    """The renderer a command uses: with --json the result alone goes to stdout (progress on stderr when it is a
    terminal or LORAKIT_PROGRESS=1); otherwise a terminal gets the bar and anything else plain lines, unless
    --log-format says otherwise."""
    from lorakit.errors import InputError

    if log_format not in FORMATS:
        raise InputError(f"--log-format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    if as_json:
        if log_format == "json" or (log_format == "auto" and os.environ.get("LORAKIT_PROGRESS", "") not in ("", "0")):
            return LineEvents(sys.stderr, as_json=log_format == "json")
        if log_format in ("auto", "rich") and sys.stderr.isatty():
            return TerminalEvents(err_console, total, label)
        if log_format == "plain":
            return LineEvents(sys.stderr)
        return Events()
    if log_format == "json":
        return LineEvents(sys.stdout, as_json=True)
    if log_format == "plain" or (log_format == "auto" and not sys.stdout.isatty()):
        return LineEvents(sys.stdout)
    return TerminalEvents(console, total, label)
