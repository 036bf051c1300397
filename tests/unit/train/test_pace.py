"""train/pace.py: whether the host or the GPU set the steps' pace, from the host's wait for the GPU in each step."""

import json

import pytest

from lorakit.config import assemble
from lorakit.train import pace as pace_mod
from lorakit.train.pace import SKIP, WINDOW, Pace, hints


def steps(p, waits, step_s=0.5, steady=True, first=2):
    """Feed step records (`wait_s` of a `step_s` step) numbered from `first`; the notices said."""
    said = []
    for k, w in enumerate(waits, first):
        got = p.take({"step": k, "step_s": step_s, "wait_s": w, "s_per_step": step_s + 0.001}, steady)
        if got:
            said.append(got)
    return said


def test_a_host_that_sets_the_pace_is_said_once_with_the_settings_that_launch_less():
    p = Pace(True, ["--set memory.cpp_wrapper=true (...)", "--set memory.cuda_graphs=true (...)"])
    assert steps(p, [0.002] * (SKIP + WINDOW - 1)) == []  # not judged before WINDOW steady steps
    said = steps(p, [0.002] * 30, first=2 + SKIP + WINDOW - 1)
    assert len(said) == 1  # once
    assert "the host sets this run's pace" in said[0] and "2.0 ms of a 0.500 s step" in said[0]  # a tenth under 10 ms
    assert f"steps {2 + SKIP}-{1 + SKIP + WINDOW}" in said[0]  # the measured steps, the settling ones left out
    assert "--set memory.cpp_wrapper=true (...) or --set memory.cuda_graphs=true (...)" in said[0]
    assert p.facts() == {"host_sets_pace": True, "wait_median_s": 0.002, "step_median_s": 0.5, "steps": WINDOW,
                         "last_step": 1 + SKIP + WINDOW}


def test_a_wait_of_a_tenth_of_a_millisecond_is_said_as_one_not_as_zero():
    said = steps(Pace(True, []), [0.0001] * 30)  # as a 24 GiB Qwen-Image run on an H200 measured it
    assert "waited for the GPU 0.1 ms of a 0.500 s step" in said[0] and said[0].endswith(")")
    assert "waited for the GPU 12 ms of a" in steps(Pace(True, []), [0.012] * 30)[0]  # whole ms from 10 ms


def test_a_run_whose_host_waits_for_the_gpu_says_nothing_and_records_it():
    p = Pace(True, ["--set memory.cpp_wrapper=true"])
    assert steps(p, [0.1] * 40) == []
    assert p.facts()["host_sets_pace"] is False and p.facts()["wait_median_s"] == 0.1


def test_only_steady_steps_count_and_a_run_off_the_gpu_is_not_judged():
    p = Pace(True, [])
    assert steps(p, [0.0] * 40, step_s=30.0, steady=False) == []  # compiling steps, the first one
    assert p.facts() is None
    said = steps(p, [0.001] * (SKIP + WINDOW))
    assert len(said) == 1 and "fewer launches" not in said[0]  # nothing this run could take: no hint
    off = Pace(False, ["--set memory.cpp_wrapper=true"])
    assert steps(off, [0.0] * 40) == [] and off.facts() is None
    assert Pace(True, []).take({"step": 3, "step_s": 0.5}, True) is None  # a record without the wait


def resolved_memory(profile, **memory):
    cfg, _ = assemble(None, ["model.family=qwen-image"], profile=profile)
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update=memory)})


def test_hints_name_only_what_this_run_could_take(monkeypatch):
    """The C++ wrapper where its decision lets it on and it keeps the compiled recompute (lorakit's cuDNN attention),
    not where it is on already or no compiler is found; CUDA graphs where the plan could replay them."""
    import sys

    monkeypatch.setenv("CXX", sys.executable)  # a compiler found on the PATH
    base = dict(compile=True, cuda_graphs=False, compiled_recompute=True, cpp_wrapper=False)
    got = hints(resolved_memory("rtx4090", attention="cudnn", **base), "cuda:0", graphs_possible=True)
    assert [h.split(" (")[0] for h in got] == ["--set memory.cpp_wrapper=true", "--set memory.cuda_graphs=true"]
    got = hints(resolved_memory("rtx4090", attention="flash", **base), "cuda:0", graphs_possible=False)
    assert got == []  # the C++ wrapper would take the compiled recompute away; graphs not possible
    got = hints(resolved_memory("rtx4090", attention="cudnn", **{**base, "cpp_wrapper": True}), "cuda:0", False)
    assert got == []
    got = hints(resolved_memory("rtx4090", attention="cudnn", **{**base, "compile": False}), "cuda:0", False)
    assert got == []  # uncompiled blocks: nothing to launch from C++
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert hints(resolved_memory("rtx4090", attention="cudnn", **base), "cuda:0", False) == []


def test_the_run_records_each_step_s_wait_and_says_who_set_the_pace(tmp_path, tiny, monkeypatch):
    """The loop as wired: each step record carries `wait_s` (within `step_s`), the notice is an info line of the run,
    and the result carries the judgement. Judged here on the CPU (on only on a GPU otherwise), where the host waits
    for nothing: it sets the pace."""
    import io

    from lorakit.cli.logs import LineEvents
    from lorakit.plan.resolve import resolve
    from lorakit.train import loop
    from tests.unit.train.test_loop import make_cfg

    monkeypatch.setattr(pace_mod, "WINDOW", 3)
    monkeypatch.setattr(loop, "Pace", lambda on, hints: Pace(True, ["--set memory.cpp_wrapper=true"]))
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=7, sampling={"enabled": False}, output={"save_every": 0},
                   lora={"rank": 4, "targets": "attention", "dropout": 0.0})
    out = io.StringIO()
    with LineEvents(out, as_json=True, every_s=0.0) as events:
        res = loop.run(resolve(cfg), events=events)
    rows = [r for r in map(json.loads, open(res["metrics"])) if "loss" in r]
    assert all(0 <= r["wait_s"] <= r["step_s"] for r in rows)
    infos = [e["message"] for e in map(json.loads, out.getvalue().splitlines()) if e.get("event") == "info"]
    said = [m for m in infos if "the host sets this run's pace" in m]
    assert len(said) == 1 and f"steps {2 + SKIP}-{1 + SKIP + 3}" in said[0] and "memory.cpp_wrapper" in said[0]
    assert res["pace"]["host_sets_pace"] is True and res["pace"]["steps"] == 3
    assert res["pace"]["last_step"] == 1 + SKIP + 3


@pytest.mark.parametrize("wait,host", [(0.02, True), (0.03, False)])
def test_the_line_between_host_and_gpu_is_a_share_of_the_step(wait, host):
    p = Pace(True, [])
    steps(p, [wait] * (SKIP + WINDOW))  # 0.5 s steps: SHARE 5% = 25 ms
    assert p.facts()["host_sets_pace"] is host
