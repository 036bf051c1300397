"""The blocks' graphs compiled ahead in a process of their own (train/precompile.py): the copy it rehearses on, the
calls it makes (those the run hands its worker, in the same order), and the process as the run drives it."""

import contextlib
import functools
import json
import os
import re
from pathlib import Path

import pytest
import torch

from lorakit.data.demo import make_demo_dataset
from lorakit.hardware.gpu import CUSTOM_AUTOGRAD_ENV, compile_cache_dir
from lorakit.io.modules import load_component, random_component
from lorakit.plan.resolve import resolve
from lorakit.train import dims, precompile, rehearse
from lorakit.train.compile_bg import BackgroundCompile, describe
from lorakit.train.loop import run
from lorakit.train.swap import repeated_blocks
from tests.unit.train.test_compile_bg import _Heard
from tests.unit.train.test_loop import make_cfg


def test_the_copy_has_each_kind_of_block_with_the_loaded_models_dtypes_and_shapes(tiny):
    folder = tiny("flux") / "transformer"
    whole = load_component(folder, "cpu", torch.bfloat16)
    copy = random_component(folder, "cpu", torch.bfloat16, blocks=1)
    assert {type(b).__name__ for b in repeated_blocks(copy)} == {type(b).__name__ for b in repeated_blocks(whole)}
    assert len(repeated_blocks(copy)) == 2 < len(repeated_blocks(whole))  # one of each list
    kept = dict(copy.named_parameters())
    for name, p in whole.named_parameters():
        if name in kept:
            assert (kept[name].shape, kept[name].dtype) == (p.shape, p.dtype), name
    assert all(torch.isfinite(p).all() for p in kept.values())
    assert not any(p.requires_grad for p in kept.values())


class _Recorder:
    """Stands in for the process at the run's side: records what `go` hands it (the real `rehearsal_inputs`)."""

    made: list = []

    def __init__(self, cfg, device, kinds=None, build=True):
        self.cfg, self.inputs, self.parts, self.where = cfg, None, [kinds], "a separate process"
        _Recorder.made.append(self)

    def build(self, cfg, device):
        self.cfg = cfg

    def go(self, tr, conds, varying=None, carried=None, packs=None):
        self.inputs, self.varying, self.carried = precompile.rehearsal_inputs(tr, conds), varying, carried
        self.packs = packs

    def wait(self, timeout=None):
        return {"ok": True, "seconds": 0.0, "graphs": 0}

    result = wait

    def news(self):
        return None

    def close(self):
        pass


@pytest.mark.slow
def test_the_copy_meets_the_calls_the_run_hands_its_worker_first_first(tmp_path, tiny, monkeypatch):
    """The graphs the process compiles are found by the run's worker only if it compiles them for the same calls
    (shapes, strides, grad and autocast modes, train or eval), the first one first (its graph is the one made with
    the run's varying sizes symbolic, `train.dims`): the run's own loop — step 1, the step-0 grid, the other bucket
    shape when its data comes (the run leaves it to the process: no eager pass of it after step 1) — against the
    copy's rehearsal of the inputs the run handed over."""
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))  # a first run on this machine
    monkeypatch.setenv(precompile.ENV, "1")  # the CPU too
    monkeypatch.setattr(precompile, "Rehearsal", _Recorder)
    _Recorder.made = []
    handed = []
    call = BackgroundCompile.call

    def recording(self, block, compiled, args, kwargs):
        what = describe(block, args, kwargs)
        if what not in self._seen:
            handed.append(what)
        return call(self, block, compiled, args, kwargs)

    monkeypatch.setattr(BackgroundCompile, "call", recording)
    torch._dynamo.reset()
    two = make_demo_dataset(tmp_path / "two", count=4, size=[64, (96, 48)])  # two bucket shapes
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=3, lora={"dropout": 0.0}, output={"save_every": 0},
                   data={"dirs": [str(two)]}, sampling={"prompts": ["a", "b c d"]})
    try:
        r = run(resolve(cfg), events=_Heard())
    finally:
        torch._dynamo.reset()
    assert r["steps"] == 3
    (rec,) = _Recorder.made
    assert rec.inputs is not None
    assert set(rec.varying) == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}  # symbolic as in the run
    assert rec.carried == {"FluxSingleTransformerBlock": (("encoder_hidden_states",), ("hidden_states",))}
    assert rec.packs == {"FluxSingleTransformerBlock": (1, ("encoder_hidden_states", "hidden_states"))}
    cfg = rec.cfg.model_copy(update={"memory": rec.cfg.memory.model_copy(update={"compile": False})})
    assert any(not what[2] for what in handed)  # the grid's calls (no grad) were handed over too
    # one process for every kind of block, then a process per kind (the others' blocks uncompiled in it): each
    # meets its kind's calls as the run made them, in the run's order
    for kinds in (None, ["FluxTransformerBlock"], ["FluxSingleTransformerBlock"]):
        copy = rehearse.build_copy(cfg, "cpu")
        for b in repeated_blocks(copy.transformer):  # as if compiled: the process's wrappers go around the calls
            b._compiled_call_impl = b._call_impl
        rehearse.only(copy.transformer, kinds)
        dims.install(copy.transformer, *dims.from_json(dims.to_json(rec.varying, rec.carried, rec.packs)))
        met = []
        for b in repeated_blocks(copy.transformer):
            if b._compiled_call_impl is not None:
                b.register_forward_pre_hook(functools.partial(_met, met), with_kwargs=True)
        took = rehearse.rehearse(copy, rec.inputs)
        assert list(took) == ["step 1", "other shapes", "grid"] and all(v >= 0 for v in took.values())
        want = [what for what in handed if kinds is None or what[0] in kinds]
        # the run's first call first; every call the run made, met by the copy (which meets the other bucket
        # shape right after step 1's, where the run, leaving that shape to it, meets it when its data does)
        assert met[0] == want[0] and set(want) <= set(met), kinds
        assert len({what[0] for what in met}) == (2 if kinds is None else 1), kinds


def _met(met: list, block, args, kwargs) -> None:
    what = describe(block, args, kwargs)
    if what not in met:
        met.append(what)


class _Eager(precompile.Rehearsal):
    """The real processes, one per kind of block (as on a GPU with the room for them), rehearsing without compiling
    (Inductor on 2 CPU cores takes minutes for the tiny model)."""

    order: list = []  # when the processes were started and told to build their copies, among the run's phases

    def __init__(self, cfg, device, kinds=None, build=True):
        _Eager.order.append("processes started")
        super().__init__(cfg, device, precompile.repeated_block_kinds(cfg.model.family), build)

    def build(self, cfg, device):
        _Eager.order.append("copies built")
        super().build(cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile": False})}), device)


@pytest.mark.slow
@pytest.mark.parametrize("taken", ["between-two-steps", "while-the-grid-rendered"])
def test_the_run_takes_the_processs_graphs_between_two_steps_or_during_the_grid_and_says_both(tmp_path, tiny,
                                                                                               monkeypatch, taken):
    """The real process beside a run of the loop: handed its inputs once the model is prepared, waited for by the
    worker, said when its training graphs are in the cache, ended and cleaned up with the run. Then the worker hands
    the calls back: where the process was done only after the step-0 grid, the run's thread takes the training
    calls' graphs from the cache between two steps, as a phase of its own (beside the uncompiled steps the worker
    starved them: 67 s for 6 steps on an H200); where it was done while the grid rendered, the worker took them then
    and step 2 runs compiled. The step-0 grid's calls are left to the next grid (the process compiles them after the
    training ones, and goes on doing so after the run switched). (The steps, or the grid, wait for the process to end
    before the worker hands back, so the switch to compiled blocks comes at a known step whatever the machine's
    load.)"""
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    monkeypatch.setenv(precompile.ENV, "1")
    monkeypatch.setattr(precompile, "Rehearsal", _Eager)
    made = []
    init, loads = BackgroundCompile.__init__, BackgroundCompile.loads_now

    def keep(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    def settled(self):
        if self.pending and not self.sealed and self._go.is_set():  # the worker has begun: let it hand back
            self.ahead.wait(120)
            self._thread.join(120)
        return loads.fget(self)

    monkeypatch.setattr(BackgroundCompile, "__init__", keep)
    monkeypatch.setattr(BackgroundCompile, "loads_now", property(settled))
    rendering = BackgroundCompile.rendering

    @contextlib.contextmanager
    def done_during_the_grid(self):
        with rendering(self):
            if self.ahead is not None and not self.sealed:  # the process ends while the grid renders
                self.ahead.wait(120)
                self._thread.join(120)  # the worker took the training graphs, then stopped
            yield

    monkeypatch.setattr(BackgroundCompile, "rendering", done_during_the_grid if taken == "while-the-grid-rendered"
                        else lambda self: contextlib.nullcontext())  # done only after the grid
    torch._dynamo.reset()
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=6, lora={"dropout": 0.0}, output={"save_every": 0},
                   sampling={"steps": 2})
    heard = _Heard()
    heard.phase_start = lambda name: heard.lines.append(f"phase: {name}")  # where each phase begins among the lines
    _Eager.order = order = heard.lines
    try:
        r = run(resolve(cfg), events=heard)
    finally:
        torch._dynamo.reset()
    (bg,) = made
    assert bg.ahead is not None and bg.ahead.result()["ok"] is True and "grid" in bg.ahead.result()["parts"]
    assert len(bg.ahead.parts) == 2 and bg.ahead.result()["processes"] == 2
    # started (their imports) before the caching, their copies built after it, beside the model's load
    assert order.index("processes started") < order.index("phase: cache") < order.index("copies built") < \
        order.index("phase: load model")
    assert not bg.ahead.folder.exists() and bg.ahead.done  # ended and cleaned up with the run
    said = [m for m in heard.lines if "compiled in 2 separate processes" in m]
    assert len(said) == 1 and said[0].startswith(
        "the blocks' 0 graphs compiled in 2 separate processes (a kind of block each, at once) in")
    assert "(step 1 " in said[0] and ", other shapes " in said[0] and ", grid " not in said[0]  # said before the grid
    assert said[0].endswith("the run takes them from there (while a grid renders, else between two steps); the "
                            "grid's follow there")
    rows = [json.loads(x) for x in open(r["metrics"])]
    assert bg.handed_back and not bg.running and bg.sealed
    loads = [p for p in heard.phases if p[0] == "the compiled blocks from the compile cache"]
    if taken == "while-the-grid-rendered":
        assert [x["step"] for x in rows if not x.get("eager_blocks")] == [2, 3, 4, 5, 6]  # compiled from step 2 on
        used = [m for m in heard.lines if m.startswith("taken from the compile cache while the grid rendered (")]
        assert used and not loads and bg.taken_beside_grid > 0  # no phase between steps: nothing was left to take
        step = 2
    else:
        assert [x["step"] for x in rows if not x.get("eager_blocks")] == [3, 4, 5, 6]  # compiled from step 3 on
        used = [m for m in heard.lines if m.startswith("taken from the compile cache between two steps (")]
        phase = heard.lines.index("phase: the compiled blocks from the compile cache")
        assert heard.lines.index(said[0]) < phase < heard.lines.index(used[0])  # the process's end said first
        assert loads == [("the compiled blocks from the compile cache", None)] and bg.taken_beside_grid == 0
        step = 3
    assert used and "(no grad)" not in used[0]  # the training calls only: the grid's at the next grid
    assert heard.lines.index(said[0]) < heard.lines.index(used[0])
    assert re.search(rf"the blocks run compiled from step {step}; the grid's \d+ call\(s\) take theirs from the "
                     r"cache at the next grid$", used[0])


def _proc(pid: int, what: str) -> list[str]:
    """A started process's command line or environment, as it was exec'd. Popen returns once the exec has begun, and
    the kernel fills these in a moment later (read at once, the environment came back empty in one CI run)."""
    import time

    for _ in range(100):
        got = Path(f"/proc/{pid}/{what}").read_text().split("\0")
        if got != [""]:
            return got
        time.sleep(0.05)
    raise AssertionError(f"/proc/{pid}/{what} stayed empty")


@pytest.mark.slow
def test_a_first_runs_processes_start_with_its_config_check_and_its_setup_takes_or_ends_them(tmp_path, tiny,
                                                                                            monkeypatch, request):
    """`lorakit train` starts a first run's compile processes once its config is read (their imports beside the
    checks), and the run's `Rehearsal` takes them (their folder too) or the setup ends them. Not where the run will
    not want them: a plan with an 8-bit base, compile_background false, or a family already run here."""
    import lorakit.train.precompile as pre

    monkeypatch.setenv(pre.ENV, "1")  # the CPU's processes as a GPU's
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), memory={"compile": True})
    try:
        assert pre.start_early(cfg, "cpu") == 1 and pre.start_early(cfg, "cpu") == 0  # once
        (early,), folder = pre.EARLY["parts"], pre.EARLY["folder"]
        taken = pre.Rehearsal(cfg, "cpu", build=False)
        assert taken.parts == [early] and taken.folder == folder and not pre.EARLY and early.proc.poll() is None
        assert _proc(early.proc.pid, "cmdline")[1:4] == [
            "-m", "lorakit.train.rehearse", ""]  # compiling on the CPU: its compile workers start when it compiles
        taken.close()
        assert not folder.exists() and early.proc.poll() is not None
        assert pre.start_early(cfg, "cpu") == 1
        (left,), folder = pre.EARLY["parts"], pre.EARLY["folder"]
        pre.drop_early()  # the run did not want them
        assert not pre.EARLY and not folder.exists() and left.proc.poll() is not None
        for memory in ({"compile_background": False}, {"base_quant": "int8"}):
            other = cfg.model_copy(update={"memory": cfg.memory.model_copy(update=memory)})
            assert pre.start_early(other, "cpu") == 0
        # on a GPU they get the environment the run's setup makes (its compile cache, where the run then finds
        # their graphs): started before the setup, they inherit it from here
        import torch._functorch.config as functorch_config

        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # all four restored after the test
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(CUSTOM_AUTOGRAD_ENV, "0")
        # torch's own undo: pytest's found no attribute to put back (torch's config module answers through its
        # __getattr__) and deleted it, which hid the setting from every later test in the process
        patched = functorch_config.patch(autograd_cache_allow_custom_autograd_functions=False)
        patched.__enter__()
        request.addfinalizer(lambda: patched.__exit__(None, None, None))
        assert pre.start_early(cfg, "cuda") == 1  # a CPU machine here: the process only imports, then is ended
        (gpu,) = pre.EARLY["parts"]
        env = dict(x.split("=", 1) for x in _proc(gpu.proc.pid, "environ") if "=" in x)
        assert env["TORCHINDUCTOR_CACHE_DIR"] == compile_cache_dir() and env[CUSTOM_AUTOGRAD_ENV] == "1"
        assert _proc(gpu.proc.pid, "cmdline")[3] == rehearse.WARM  # its compile workers start once its imports are done
        assert compile_cache_dir().startswith(os.environ["LORAKIT_CACHE"])  # lorakit's cache, not Inductor's default
        pre.drop_early()
        monkeypatch.setattr(pre.os, "cpu_count", lambda: 16)  # 8 cores for each kind of FLUX's blocks
        monkeypatch.setattr(pre, "repeated_block_kinds", lambda family: pytest.fail("diffusers imported to count"))
        assert pre.start_early(cfg, "cuda") == 2 and len({p.proc.pid for p in pre.EARLY["parts"]}) == 2  # at once
        pre.drop_early()
        monkeypatch.setattr(pre, "cached_family_report", lambda *a: object())
        monkeypatch.setattr(pre.probe_mod, "facts_cached", lambda: True)
        assert pre.start_early(cfg, "cpu") == 0  # measured here before: its setup starts them where it wants them
    finally:
        pre.drop_early()


@pytest.mark.slow
def test_a_process_that_fails_says_why_in_the_runs_words_and_ends(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"))
    broken = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tmp_path / "gone")})})
    p = precompile.Rehearsal(broken, "cpu")
    try:
        got = p.wait(120)
        assert got["ok"] is False and "exited with code 1" in got["why"] and "gone" in got["why"]
        said = p.news()
        assert said.startswith("the separate compile process failed (exited with code 1") and said.endswith(
            "the worker compiles the blocks itself")
        assert p.news() is None  # said once
    finally:
        p.close()
    assert not p.folder.exists()
    p.close()  # again: nothing left to do


def test_the_process_runs_only_where_the_card_has_room_for_it_beside_the_uncompiled_steps():
    from lorakit.config import assemble
    from lorakit.plan.memory import estimate

    cfg, _ = assemble(None, ["model.family=flux", "data.resolution=1024"], "datacenter")
    est = estimate(cfg, 1)
    assert 3.0 < precompile.child_gib(est) < 6.0  # FLUX.1-dev 1024²: 3.9 GiB more at the card's peak (H100)
    assert precompile.lacks_room(est, 79.2) is None  # an 80 GB card
    why = precompile.lacks_room(est, 56.0)
    assert why.startswith("no room beside the run for a separate compile process (about")
    assert precompile.lacks_room(None, 56.0) is None  # no estimate (the CPU): nothing to refuse on
    one_not_two = est["uncompiled_gib"] + 1.5 * precompile.child_gib(est) + precompile.PLAN_MARGIN_GIB
    assert precompile.lacks_room(est, one_not_two) is None and precompile.lacks_room(est, one_not_two, processes=2)


def test_a_family_with_two_kinds_of_block_compiles_them_in_a_process_each_where_the_card_has_room(monkeypatch):
    from lorakit.config import assemble
    from lorakit.plan.memory import estimate

    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)
    flux, _ = assemble(None, ["model.family=flux", "data.resolution=1024"], "datacenter")
    est = estimate(flux, 1)
    both = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert precompile.kinds_apart(flux, "cuda:0", est, 139.0) == both
    assert precompile.kinds_apart(flux, "cuda:0", est, est["uncompiled_gib"] + 1.5 * precompile.child_gib(est)
                                  + precompile.PLAN_MARGIN_GIB) is None  # room for one process, not two
    assert precompile.kinds_apart(flux, "cpu", None, None) is None
    qwen, _ = assemble(None, ["model.family=qwen-image", "data.resolution=1024"], "datacenter")
    assert precompile.kinds_apart(qwen, "cuda:0", estimate(qwen, 1), 139.0) is None  # one kind: one process
    assert precompile.kinds_apart(flux, "cuda:1", est, 139.0, world=2) == both  # 8 cores a rank
    assert precompile.kinds_apart(flux, "cuda:1", est, 139.0, world=4) is None  # 4 a rank: one process each
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 4)
    assert precompile.kinds_apart(flux, "cuda:0", est, 139.0) is None  # too few cores to compile two at once


class _Told:
    """A process that has said `got`."""

    def __init__(self, got: dict):
        self.got = got

    def training(self) -> dict:
        return self.got

    result = training


def test_the_processes_news_is_one_failure_where_one_failed_else_the_slowest_and_all_graphs():
    a = {"ok": True, "seconds": 12.0, "graphs": 2, "parts": {"step 1": 11.0, "other shapes": 1.0}, "grid_prompts": 4}
    b = {"ok": True, "seconds": 19.5, "graphs": 3, "parts": {"step 1": 19.0, "other shapes": 0.5}, "grid_prompts": 4}
    assert precompile.merged([a]) == a
    late = {"late": 3.5, "start": {"imports": 12.0, "copy": 4.0}}
    assert precompile.merged([a | {"late": 0.0}, b | late]) == {
        "ok": True, "seconds": 19.5, "graphs": 5, "processes": 2, "grid_prompts": 4,
        "parts": {"step 1": 19.0, "other shapes": 1.0}} | late
    both = object.__new__(precompile.Rehearsal)
    both.said, both.parts = False, [_Told(a | {"late": 0.0}), _Told(b | late)]
    assert both.news() == (
        "the blocks' 5 graphs compiled in 2 separate processes (a kind of block each, at once) in 19.5 s (step 1 "
        "19.0 s, other shapes 1.0 s, begun 3.5 s after the run handed over its inputs (its imports 12.0 s, its copy "
        "4.0 s)) (into this machine's compile cache); the run takes them from there (while a grid renders, else "
        "between two steps); the grid's follow there")
    early = {"late": 3.5, "start": {"imports": 12.0, "copy": 4.0, "before": 14.5, "built": 1.5}}  # ready in time, begun
    both.said, both.parts = False, [_Told(a | {"late": 0.0}), _Told(b | early)]  # late all the same (a starved CPU)
    assert "(its imports 12.0 s, its copy 4.0 s, started 14.5 s before the hand-over, built 1.5 s before it))" in \
        both.news()
    early["start"]["read"] = 2.0  # where the 3.5 s went: 2.0 before it read its inputs, 1.5 loading them
    both.said, both.parts = False, [_Told(a | {"late": 0.0}), _Told(b | early)]
    assert "built 1.5 s before it, its inputs read 2.0 s after it))" in both.news()
    assert precompile.merged([a, {"ok": None}]) == {"ok": None}  # one is still compiling
    bad = {"ok": False, "why": "FluxSingleTransformerBlock: exited with code 1"}
    assert precompile.merged([{"ok": None}, bad]) == bad  # a failure is news at once: the worker compiles


def test_a_process_compiling_one_kind_runs_the_others_blocks_uncompiled(tiny):
    copy = random_component(tiny("flux") / "transformer", "cpu", torch.bfloat16, blocks=2)
    for b in repeated_blocks(copy):
        b._compiled_call_impl = b._call_impl
    rehearse.only(copy, ["FluxSingleTransformerBlock"])
    left = {type(b).__name__: b._compiled_call_impl is not None for b in repeated_blocks(copy)}
    assert left == {"FluxTransformerBlock": False, "FluxSingleTransformerBlock": True}
    rehearse.only(copy, None)  # one process for all: nothing changes
    assert sum(b._compiled_call_impl is not None for b in repeated_blocks(copy)) == 2


def test_a_process_that_gives_no_result_in_time_is_ended_and_said(tmp_path, tiny):
    p = precompile.Rehearsal(make_cfg(tmp_path, "flux", tiny("flux")), "cpu")  # never handed its inputs: it waits
    try:
        got = p.wait(1.5)
        assert got == {"ok": False, "why": "no result after 2 s, ended"} and p.done
        assert p.news() == "the separate compile process failed (no result after 2 s, ended); the worker compiles " \
                           "the blocks itself"
    finally:
        p.close()


def test_the_inputs_reach_the_process_through_a_file_read_without_unpickling_objects(tmp_path):
    from lorakit.models.batch import Batch
    from lorakit.train.sampling import Condition

    b = Batch(["a"], torch.ones(1, 4, 8, 8), {"prompt_embeds": torch.zeros(1, 5, 3)}, [], None, torch.ones(1))
    c = Condition("a red square", {"prompt_embeds": torch.zeros(1, 5, 3)}, (4, 8, 8))
    inputs = {"first": (b, torch.tensor([0.5]), torch.zeros(1, 4, 8, 8)), "warm": [("64x64", b)], "conds": [c]}
    torch.save(precompile.plain(inputs), tmp_path / "inputs.pt")
    got = rehearse.rebuilt(torch.load(tmp_path / "inputs.pt", weights_only=True))
    batch, sigmas, noise = got["first"]
    assert isinstance(batch, Batch) and batch.keys == ["a"] and torch.equal(batch.latents, b.latents)
    assert batch.mask is None and torch.equal(batch.weights, b.weights) and torch.equal(sigmas, torch.tensor([0.5]))
    assert got["warm"][0][0] == "64x64" and isinstance(got["warm"][0][1], Batch)
    (cond,) = got["conds"]
    assert isinstance(cond, Condition) and cond.label == "a red square" and cond.shape == (4, 8, 8)


def test_each_rank_of_a_lora_run_compiles_in_a_process_of_its_own_and_fsdp_in_its_own(tmp_path, tiny):
    # data parallel LoRA ranks hold the blocks the child rehearses; FSDP's wrapped blocks are other graphs
    from lorakit.train.precompile import RANK_VARS, wanted

    lora = make_cfg(tmp_path, "flux", tiny("flux"), steps=4, memory={"compile": True, "compile_background": True})
    assert wanted(lora, "cuda:1", 2) and wanted(lora, "cuda:0", 1)
    full = lora.model_copy(update={"method": "full"})
    assert wanted(full, "cuda:0", 1) and not wanted(full, "cuda:0", 2)
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(RANK_VARS)
