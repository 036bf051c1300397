"""How progress reads in a log file: phase lines with durations, step lines on time and on every tenth, a moving
average, a phase that runs long saying so, JSON lines, nothing cut to a terminal's width."""

import io
import itertools
import json
import re
import time

from lorakit.cli.logs import LineEvents, events_for
from lorakit.events import Events


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _rec(step, s=0.5, loss=0.25):
    return {"step": step, "loss": loss, "lr": 1e-4, "s_per_step": s}


def test_step_lines_come_at_the_first_step_each_tenth_every_10_s_and_the_last():
    clock, out = Clock(), io.StringIO()
    ev = LineEvents(out, clock=clock)
    for step in range(1, 201):
        clock.t += 0.5 if step < 100 else 3.0  # slower from step 100: 10 s pass within a tenth
        ev.step(step, 200, _rec(step))
    steps = [int(m) for m in re.findall(r"step (\d+)/200", out.getvalue())]
    assert steps[0] == 1 and steps[-1] == 200
    assert {20, 40, 60, 80, 100, 120, 140, 160, 180}.issubset(steps)
    times = [float(t) for t in re.findall(r"^\[\s*([\d.]+) s\] step", out.getvalue(), re.M)]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 10.0 + 3.0  # never more than 10 s (plus one step) apart
    assert len(steps) < 60  # not every step


def test_the_step_line_shows_the_moving_average_and_an_eta_not_the_last_step():
    out, clock = io.StringIO(), Clock()
    ev = LineEvents(out, clock=clock)
    ev.step(1, 2000, {**_rec(1, s=47.4), "gpu_gib": 42.2})  # step 1 held the compile: its own figure, no ETA from it
    assert out.getvalue().endswith("step 1/2000  loss 0.2500  lr 1.0e-04  first step 47.40 s  42.2 GiB\n")
    clock.t += 11
    ev.step(2, 2000, _rec(2, s=0.43))
    assert out.getvalue().splitlines()[-1].endswith("0.43 s/step  eta 14m19s")
    for i in range(3, 21):
        ev.step(i, 2000, _rec(i, s=1.0))
    clock.t += 11  # 10 s on: a line is due, after one slow step
    ev.step(21, 2000, _rec(21, s=9.0))
    last = out.getvalue().splitlines()[-1]
    window = [0.43] + [1.0] * 18 + [9.0]  # shown: the average of these 20 intervals, not the slow step's 9 s
    assert f"{sum(window) / 20:.2f} s/step" in last and "step 21/2000" in last
    assert f"eta {(2000 - 21) * sum(window) / 20 // 60:.0f}m" in last


def test_a_phase_line_names_its_duration_and_what_it_did():
    out = io.StringIO()
    ev = LineEvents(out, clock=Clock())
    ev.phase_end("load model", 12.34, {"gib": 23.8, "gb_per_s": 1.9})
    ev.phase_end("cache", 3.0, {"items": 16, "reused": 0, "skipped": 0})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("load model: 12.3 s (23.8 GiB, 1.9 GB/s)")
    assert lines[1].endswith("cache: 3.0 s (items 16, reused 0, skipped 0)")


def test_a_long_phase_says_it_is_still_running_and_stops_when_it_ends():
    out = io.StringIO()
    with LineEvents(out, every_s=0.2) as ev:
        with ev.phase("step 1 (compiling the blocks)"):
            time.sleep(0.9)
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    running = [x for x in lines if "step 1 (compiling the blocks)... " in x]
    assert len(running) >= 2, lines
    assert lines.index(running[-1]) < len(lines) - 1 and re.search(r"compiling the blocks\): 0\.9 s", lines[-1])


def test_a_failed_phase_is_not_said_to_run_on():
    out = io.StringIO()
    with LineEvents(out, every_s=0.1) as ev:
        try:
            with ev.phase("load model"):
                raise OSError("disk gone")
        except OSError:
            pass
        time.sleep(0.4)
    assert "load model" not in out.getvalue()


def test_json_lines_carry_the_same_events():
    out = io.StringIO()
    ev = LineEvents(out, as_json=True, clock=Clock())
    ev.phase_end("load model", 2.0, {"gib": 1.5, "gb_per_s": 0.75})
    ev.step(1, 10, _rec(1))
    ev.step(2, 10, _rec(2))
    ev.warn("a warning")
    ev.result({"steps": 10})
    recs = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["event"] for r in recs] == ["phase", "step", "step", "warning", "result"]
    assert recs[0] == {"t": 0.0, "event": "phase", "name": "load model", "seconds": 2.0, "gib": 1.5,
                       "gb_per_s": 0.75}
    assert recs[1]["s_per_step_avg"] is None and recs[1]["eta_s"] is None  # the first step: no pace yet
    assert recs[2]["s_per_step_avg"] == 0.5 and recs[2]["eta_s"] == 4.0 and recs[2]["total"] == 10


def test_lines_are_never_cut_to_a_terminal_width():
    out = io.StringIO()
    ev = LineEvents(out, clock=Clock())
    long = "/data/" + "very-long-folder-name/" * 12 + "lora.safetensors"
    ev.info(f"wrote {long}")
    assert long in out.getvalue() and "…" not in out.getvalue()


def test_a_file_or_pipe_gets_plain_lines_and_a_bad_format_is_refused(capsys):
    import pytest

    from lorakit.errors import InputError

    ev = events_for("auto", False, None, None, 10)  # pytest's captured stdout is not a terminal
    assert isinstance(ev, LineEvents) and not ev.as_json
    assert events_for("json", False, None, None).as_json
    assert type(events_for("auto", True, None, None)) is Events  # --json: the result alone on stdout
    with pytest.raises(InputError, match="--log-format must be one of auto, rich, plain, json"):
        events_for("fancy", False, None, None)
