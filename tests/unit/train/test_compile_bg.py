"""The blocks compiled by a worker thread while steps run eager (train/compile_bg.py), on the tiny FLUX transformer
with a LoRA and partial gradient checkpointing. torch.compile's `aot_eager` backend stands in for Inductor on the
CPU: the same Dynamo capture, guards and forward/backward graphs, without a C++ toolchain."""

import functools
import json
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

from lorakit.config import assemble
from lorakit.events import Events
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import resolve
from lorakit.train.compile_bg import BackgroundCompile, describe
from lorakit.train.compile_news import summary
from lorakit.train.loop import run
from lorakit.train.lora import add_lora
from lorakit.train.prepare import checkpoint_blocks
from lorakit.train.swap import repeated_blocks
from tests.unit.train.test_loop import make_cfg


def _model(folder, adapter):
    cfg, _ = assemble(None, ["model.family=flux", "lora.rank=4"], "cpu")
    tr = load_component(folder / "transformer", "cpu", torch.float32)
    add_lora(tr, adapter, cfg)
    tr.train()
    checkpoint_blocks(tr, 1)  # the first block recomputes in backward: its recompute runs the same code
    return tr


def _step(tr, adapter, batch, sigma=0.6):
    v = adapter.predict(tr, batch.latents.clone(), torch.tensor([sigma]), batch.text)
    v.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in tr.named_parameters() if p.requires_grad}
    tr.zero_grad(set_to_none=True)
    return v.detach(), grads


@pytest.mark.slow
def test_the_worker_compiles_every_call_the_blocks_make_and_the_run_never_compiles(tiny):
    torch._dynamo.reset()
    counters.clear()  # graphs other tests made in this process are not the worker's
    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    config = dict(load_component(folder / "transformer").config)
    small, large = (adapter.example_inputs(config, res, 8, gen) for res in (64, 96))  # two buckets
    ref = _model(folder, adapter)
    want_small, want_large = _step(ref, adapter, small), _step(ref, adapter, large)

    tr = _model(folder, adapter)
    tr.load_state_dict(ref.state_dict())
    bg = BackgroundCompile(repeated_blocks(tr), {"backend": "aot_eager"}, "cpu")
    try:
        got = _step(tr, adapter, small)  # eager: step 1 runs alone, the worker begins at the next `advance`
        assert bg.eager_calls > 0 and bg.pending > 0
        time.sleep(0.5)
        assert counters["stats"]["unique_graphs"] == 0 and not bg._done  # nothing compiled beside step 1
        torch.testing.assert_close(got[0], want_small[0])
        deadline = time.monotonic() + 120
        while True:  # steps run eager until the worker is done; then all it made goes into use, between steps
            ready = bg.advance()
            assert all(r.failed is None for r in ready), [r.failed for r in ready]
            if ready:
                break
            assert time.monotonic() < deadline, "the worker did not finish"
            time.sleep(0.05)
        kinds = {what[0] for what in bg.active}
        assert kinds == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
        # the double block's input needs no grad (the embedders are frozen), the single block's does
        needs = {what[0]: what[3][1][0][4] for what in bg.active}
        assert needs == {"FluxTransformerBlock": False, "FluxSingleTransformerBlock": True}
        made = counters["stats"]["unique_graphs"]
        assert made > 0 and bg.own_graphs() == 0

        out, grads = _step(tr, adapter, small)  # compiled now: no compile in the run's thread
        assert bg.eager_calls == 0
        assert counters["stats"]["unique_graphs"] == made and bg.own_graphs() == 0
        torch.testing.assert_close(out, want_small[0])
        for n, g in want_small[1].items():
            torch.testing.assert_close(grads[n], g, msg=n)

        assert bg.sealed and not bg._thread.is_alive()  # idle: it stopped once everything was in use
        bg.advance()  # a second bucket after that: compiled in the run (it waits, as without a worker)
        out, grads = _step(tr, adapter, large)
        assert bg.eager_calls == 0 and bg.own_graphs() > 0
        torch.testing.assert_close(out, want_large[0])
        for n, g in want_large[1].items():
            torch.testing.assert_close(grads[n], g, msg=n)
        bg.close()
        assert not bg._thread.is_alive()
        assert all(p.grad is None for p in tr.parameters())  # the worker's passes never touched the run's grads
    finally:
        bg.close()
        torch._dynamo.reset()


class _Ahead:
    """Stands for `train.precompile.Rehearsal` (the separate compile process): its result once waited for."""

    def __init__(self, ok: bool):
        self.ok, self.closed, self.asked = ok, False, []

    def wait(self, timeout=None, training=False):
        self.asked.append(training)
        return {"ok": True, "seconds": 1.0, "graphs": 4} if self.ok else {"ok": False, "why": "exited with code 1"}

    def close(self):
        self.closed = True


def _beside_a_process(tiny, ahead):
    """The tiny FLUX transformer with its background compile, `ahead` standing for the separate process, and where
    each call was compiled or taken (True: the run's thread)."""
    torch._dynamo.reset()
    counters.clear()
    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    small = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8, gen)
    tr = _model(folder, adapter)
    bg = BackgroundCompile(repeated_blocks(tr), {"backend": "aot_eager"}, "cpu")
    bg.ahead = ahead
    where = []
    compile_one = bg._compile
    bg._compile = lambda job: (where.append(threading.current_thread() is threading.main_thread()), compile_one(job))[1]
    return adapter, small, tr, bg, where


@pytest.mark.slow
@pytest.mark.parametrize("ok", [True, False])
def test_after_the_compile_process_the_run_takes_the_graphs_itself_or_where_it_failed_the_worker_compiles(tiny, ok):
    """Once the separate process has compiled the training calls, the worker compiles nothing: it hands the calls
    back and the run's thread takes them (from the cache), all at once, when the loop asks (`advance(load=True)`) —
    beside the uncompiled steps the worker starved them (FLUX.1-dev, H200, 2026-11-28: 67 s for 6 steps). A grid's
    calls (eval, no grad) are left to their next call, and the process goes on (it compiles them after the training
    ones) until the run ends. Where the process failed, the worker compiles them itself, as before."""
    adapter, small, tr, bg, where = _beside_a_process(tiny, _Ahead(ok))
    try:
        _step(tr, adapter, small)  # step 1, eager
        tr.eval()
        with torch.no_grad():  # the step-0 grid's calls
            adapter.predict(tr, small.latents.clone(), torch.tensor([0.6]), small.text)
        tr.train()
        assert bg.pending > 0 and bg.advance() == []  # the worker begins: waits for the process
        deadline = time.monotonic() + 120
        while bg._thread.is_alive() and len(bg._done) < bg.pending and time.monotonic() < deadline:
            time.sleep(0.05)  # handed back (the thread ends), or compiled by the worker (it then waits for more)
        if ok:
            assert bg.handed_back and bg.loads_now and not where
            assert bg.advance() == [] and bg.pending > 0  # not without `load`: the loop makes it a phase of its own
            ready = bg.advance(load=True)
            assert ready and all(r.failed is None for r in ready) and where and all(where)  # in the run's thread
            assert bg.ahead.asked == [True]  # it waited for the training graphs, not the process's end
            grid = [r for r in ready if r.later]
            assert grid and all(not r.what[1] and not r.what[2] for r in grid) and len(where) == len(ready) - len(grid)
            assert not bg.ahead.closed  # sealed: the process goes on with the grid's graphs
        else:
            assert not bg.handed_back and not bg.loads_now and where and not any(where)  # in the worker's
            ready = bg.advance()
        assert ready and bg.sealed and bg.own_graphs() == 0
        _step(tr, adapter, small)
        assert bg.eager_calls == 0 and bg.own_graphs() == 0  # compiled now, nothing compiled in the step
    finally:
        bg.close()
        torch._dynamo.reset()
    assert bg.ahead.closed


class _Later(_Ahead):
    """A separate process whose training graphs are in the cache once `done` is set."""

    def __init__(self):
        super().__init__(True)
        self.done = threading.Event()

    def wait(self, timeout=None, training=False):
        self.done.wait(60)
        return super().wait(timeout, training)

    def news(self):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("during", [True, False], ids=["process-done-during-the-grid", "process-done-after-it"])
def test_the_worker_takes_the_graphs_while_a_grid_renders_and_leaves_the_rest_to_the_run(tiny, during):
    """The step-0 grid renders right after step 1 with its block calls uncompiled and GPU-bound (Qwen-Image 1024²,
    one H200, 2026-11-30: 39.0 s, the process's training graph in the cache 20.8 s into it, then taken in 3.8 s by
    the run's thread before step 3): where the process is done while the grid renders, the worker takes the training
    graphs then, in its thread, and the next `advance` puts them into use with no phase of its own; the grid's own
    calls are left to their next grid. Where it is done only after the grid, the run's thread takes them as before."""
    adapter, small, tr, bg, where = _beside_a_process(tiny, _Later())
    try:
        _step(tr, adapter, small)  # step 1, eager
        training = bg.pending
        with bg.rendering():  # the step-0 grid
            tr.eval()
            with torch.no_grad():
                adapter.predict(tr, small.latents.clone(), torch.tensor([0.6]), small.text)
            tr.train()
            if during:
                bg.ahead.done.set()
                deadline = time.monotonic() + 120
                while len(where) < training and time.monotonic() < deadline:
                    time.sleep(0.05)  # the grid goes on meanwhile
        assert bg.pending > training  # the grid's calls were described too
        if during:
            assert where == [False] * training and bg.taken_beside_grid == training  # all in the worker's thread
            assert not bg.loads_now  # nothing left for a phase between steps
            given = bg.pending
            ready = bg.advance()
            assert bg.sealed and len(ready) == given and sum(r.later for r in ready) == given - training
            heard = []
            from lorakit.train.compile_news import news

            news(bg, ready, 2, heard.append, heard.append)
            assert heard[-1].startswith("taken from the compile cache while the grid rendered (")
        else:
            assert where == [] and not bg.handed_back  # the process was not done: nothing taken beside the grid
            bg.ahead.done.set()
            deadline = time.monotonic() + 60
            while not bg.loads_now and time.monotonic() < deadline:
                time.sleep(0.05)
            ready = bg.advance(load=True)
            assert where == [True] * training and bg.taken_beside_grid == 0  # in the run's thread, between steps
        assert bg.sealed and bg.own_graphs() == 0 and all(r.failed is None for r in ready)
        _step(tr, adapter, small)
        assert bg.eager_calls == 0 and bg.own_graphs() == 0  # compiled now, nothing compiled in the step
    finally:
        bg.ahead.done.set()
        bg.close()
        torch._dynamo.reset()


def test_the_processs_training_graphs_are_news_while_it_still_compiles_the_grids_not_a_warning():
    from types import SimpleNamespace

    from lorakit.train.compile_news import news

    class Compiling:  # its training graphs in the cache, the grid's still compiling (the process runs on)
        def news(self):
            return "the blocks' 4 graphs compiled in a separate process in 59.4 s"

        def state(self):
            return {"ok": True, "seconds": 59.4, "graphs": 4}

        def result(self):
            return {"ok": None}

    infos, notes = [], []
    news(SimpleNamespace(ahead=Compiling(), pending=3, handed_back=True), [], 2, infos.append, notes.append)
    assert infos == ["the blocks' 4 graphs compiled in a separate process in 59.4 s"] and notes == []


def test_a_description_names_what_a_compiled_graph_depends_on():
    block = torch.nn.Linear(4, 4)
    x = torch.zeros(2, 3, 4)
    a = describe(block, (x,), {})
    assert describe(block, (x.clone(),), {}) == a
    assert describe(block, (x.requires_grad_(True),), {}) != a
    assert describe(block, (torch.zeros(2, 5, 4),), {}) != a
    with torch.no_grad():
        assert describe(block, (torch.zeros(2, 3, 4),), {}) != a
        assert summary(describe(block, (torch.zeros(2, 3, 4),), {})) == "Linear 2x3x4 (no grad)"
        # the largest input names the call (a FLUX block's image tokens, not its 512 text tokens)
        assert summary(describe(block, (), {"a": torch.zeros(1, 512, 4), "b": torch.zeros(1, 4096, 4)})) == \
            "Linear 1x4096x4 (no grad)"
    block.eval()
    assert describe(block, (torch.zeros(2, 3, 4),), {}) != a


def captions_of_lengths(folder) -> None:
    """Each caption of the dataset a different number of words (3, 6, 9, ...): text lengths that differ."""
    words = "a small red circle near the middle of a wide plain blue field".split()
    for k, txt in enumerate(sorted(folder.glob("*.txt"))):
        txt.write_text(" ".join(words[: 3 + 3 * k]))


def run_fresh(cfg, heard):
    """`lorakit train`'s loop with torch.compile's caches empty before and after."""
    torch._dynamo.reset()
    try:
        return run(resolve(cfg), events=heard)
    finally:
        torch._dynamo.reset()


class _Heard(Events):
    def __init__(self):
        self.lines, self.phases = [], []

    def info(self, msg):
        self.lines.append(msg)

    def phase_end(self, name, seconds, facts):
        self.phases.append((name, facts.get("step")))


@pytest.mark.slow
def test_a_run_steps_while_its_blocks_compile_and_then_runs_them_compiled(tmp_path, tiny, monkeypatch):
    """`lorakit train`'s loop with memory.compile_background on (the CPU never compiles: the decision is patched,
    torch.compile given the aot_eager backend): step 1 does not wait, the compiled blocks come into use between
    steps and the log says from which, no step waits for a compile before that, and the run ends with the worker
    stopped."""
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))  # a first run on this machine
    torch._dynamo.reset()
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=150, lora={"dropout": 0.0},
                   sampling={"enabled": False}, output={"save_every": 0})
    resolved = resolve(cfg)
    assert resolved.cfg.memory.compile and resolved.cfg.memory.compile_background is True
    heard = _Heard()
    try:
        r = run(resolved, events=heard)
    finally:
        torch._dynamo.reset()
    assert r["steps"] == 150
    assert not [t for t in threading.enumerate() if t.name == "lorakit-compile"]  # the worker stopped with the run
    rows = [json.loads(x) for x in open(r["metrics"])]
    assert rows[0].get("eager_blocks")  # step 1 ran the blocks as they are
    compiled = [x["step"] for x in rows if not x.get("eager_blocks")]
    assert compiled, "no step ran the compiled blocks"
    used = [m for m in heard.lines if m.startswith("compiled in the background")]
    assert used and used[0].endswith(f"the blocks run compiled from step {compiled[0]}")
    assert r["compiled_from"] == compiled[0]  # the result says it too
    assert all(x.get("eager_blocks") for x in rows[:compiled[0] - 1])
    # no step waited for the compiler before the worker's blocks came into use (a bucket met after that compiles in
    # the run, as without the worker)
    assert all(step >= compiled[0] for name, step in heard.phases if name == "compile")
    # every bucket shape was handed to the worker right after step 1 (the run met none later that waited)
    assert any("handed to the background compile before the run meets them" in m for m in heard.lines) or \
        rows[0]["size"] and len({x["size"] for x in rows}) == 1
    assert not [name for name, step in heard.phases if name == "compile"]


@pytest.mark.slow
def test_the_last_grids_estimate_says_its_blocks_ran_uncompiled(tmp_path, tiny, monkeypatch):
    """The step-0 grid renders right after step 1, while the blocks still compile in the background: its time
    overstates a grid with compiled blocks (Qwen-Image 1024², one H200, 2026-11-30: 39.0 s, the last grid 27.3 s),
    so the next grid's line says so beside the estimate."""
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))  # a first run on this machine
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=6, lora={"dropout": 0.0}, output={"save_every": 0},
                   sampling={"prompts": ["a red circle"], "steps": 2, "size": 32})
    heard = _Heard()
    r = run_fresh(cfg, heard)
    assert r["steps"] == 6
    said = [m for m in heard.lines if m.startswith("samples (step ")]
    assert said[0] == ("samples (step 0): 1 image(s) x 2 steps — the untrained LoRA, to compare with "
                       "(sampling.first: false skips it)")
    assert said[-1].startswith("samples (step 6): 1 image(s) x 2 steps, about ")
    assert said[-1].endswith(" s as the last grid, whose blocks ran uncompiled")


@pytest.mark.slow
def test_a_second_run_with_the_same_settings_compiles_from_the_cache_and_is_steady_from_step_2(tmp_path, tiny,
                                                                                               monkeypatch):
    """Once a run has compiled every bucket shape, this machine's compile cache holds them (`train.warm`): a second
    run with the same settings compiles at step 1 and in one phase before step 2 — seconds from the cache — instead
    of running eager steps beside the background worker, which were the slow ones (H100, 2026-11-26: 2.7-11.7 s
    between steps against 0.44 while the worker compiled)."""
    import lorakit.plan.resolve as resolve_mod
    from lorakit.train import warm

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    torch._dynamo.reset()
    runs = []
    try:
        for k, steps in ((1, 150), (2, 6)):
            cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=steps, lora={"dropout": 0.0},
                           sampling={"enabled": False}, output={"dir": str(tmp_path / f"out{k}"), "save_every": 0})
            heard = _Heard()
            r = run(resolve(cfg), events=heard)
            runs.append((r, heard, [json.loads(x) for x in open(r["metrics"])]))
            torch._dynamo.reset()
    finally:
        torch._dynamo.reset()
    (r1, heard1, rows1), (r2, heard2, rows2) = runs
    assert any(m.startswith("compiled in the background") for m in heard1.lines)
    assert list((tmp_path / "compile-cache" / warm.FOLDER).glob("*.json"))  # what the first run compiled, recorded
    said = [m for m in heard2.lines if "from this machine's compile cache" in m]
    assert said and "not in the background" in said[0]
    assert not any(x.get("eager_blocks") for x in rows2)  # no step beside a worker: compiled from step 1
    assert r2["compiled_from"] == 1 and r1["compiled_from"] > 1
    sizes = {x["size"] for x in rows1}
    if len(sizes) > 1:  # the other bucket shapes compiled in one phase before step 2, no step waited later
        assert any(name.startswith(f"compile {len(sizes) - 1} more bucket shape") for name, _ in heard2.phases)
    assert not [s for name, s in heard2.phases if name == "compile"]


@pytest.mark.slow
def test_a_worker_that_cannot_start_leaves_the_compiling_to_the_run(tiny, monkeypatch):
    """The worker's own failure (on the H100 once: a device it could not select) is not a run that stays uncompiled:
    what it was given is handed back as failed, and the blocks compile in the run at their next call."""
    torch._dynamo.reset()
    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                   torch.Generator().manual_seed(0))

    def broken(self):
        while self._jobs.empty():  # the first step's calls are given to it first
            time.sleep(0.01)
        time.sleep(0.2)
        raise ValueError("Expected a torch.device with a specified index")

    monkeypatch.setattr(BackgroundCompile, "_jobs_loop", broken)
    counters.clear()
    tr = _model(folder, adapter)
    bg = BackgroundCompile(repeated_blocks(tr), {"backend": "aot_eager"}, "cpu")
    try:
        want = _step(tr, adapter, batch)
        bg._thread.join()
        failed = bg.advance()
        assert failed and all("specified index" in r.failed for r in failed) and bg.pending == 0
        got = _step(tr, adapter, batch)  # compiled in the run's thread now
        assert bg.eager_calls == 0 and bg.own_graphs() > 0
        torch.testing.assert_close(got[0], want[0])
    finally:
        bg.close()
        torch._dynamo.reset()


_RACE = """
import sys, threading, torch
from lorakit.train.compile_bg import thread_own_fx_patches
if sys.argv[1] == "kept":
    assert thread_own_fx_patches()
inside, release, traced = threading.Event(), threading.Event(), {}

class Waits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)

    def forward(self, x):
        inside.set()
        release.wait(30)
        return self.inner(x) + 1

def trace():
    traced["graph"] = torch.fx.symbolic_trace(Waits()).graph

t = threading.Thread(target=trace)
t.start()
inside.wait(30)
lin = torch.nn.Linear(2, 2)
try:  # this thread's module, called while the other thread traces
    print("ran", bool(torch.equal(lin(torch.ones(1, 2)), lin.weight.sum(1, keepdim=True).T + lin.bias)))
except NameError as e:
    print("failed", e)
release.set()
t.join()
print("tracer saw", [n.target for n in traced["graph"].nodes if n.op == "call_module"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("kept", [False, True], ids=["torch-as-is", "kept-to-its-thread"])
def test_a_module_called_while_another_thread_traces_runs_as_itself(kept):
    """What the H100 run met (torch 2.11): AOTAutograd's trace in the worker replaced torch.nn.Module.__call__ for
    the whole process, and the run's eager step failed ("module is not installed as a submodule"). torch as it is
    fails so here too; with the tracer's patches kept to its thread, the run's call computes as itself and the trace
    still records its own module calls."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", _RACE, "kept" if kept else "as-is"], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert lines[0] == ("ran True" if kept else "failed module is not installed as a submodule"), lines
    assert lines[1] == "tracer saw ['inner']"


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_captions_of_every_length_run_the_graphs_compiled_before_step_2(tmp_path, tiny, monkeypatch, batch):
    """Qwen-Image keeps each prompt's own length, so its blocks meet a new text length at many steps. Right after
    step 1 the blocks are also run with a text one token shorter (`train.warm.to_warm`): torch then compiles them
    for any length, and no later step waits for the compiler (H100, 2026-11-26: without it, a 39.9 s compile at
    step 4 of a Qwen-Image run whose bucket shapes had all been compiled). A batch of two prompts of different
    lengths calls the blocks with a text mask, another graph: it is compiled in the same phase."""
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    cfg = make_cfg(tmp_path, "qwen-image", tiny("qwen-image"), steps=12, lora={"dropout": 0.0},
                   sampling={"enabled": False}, output={"save_every": 0}, memory={"compile_background": False},
                   schedule={"batch_size": batch})
    captions_of_lengths(tmp_path / "d")
    heard = _Heard()
    r = run_fresh(cfg, heard)
    assert r["steps"] == 12 and r["compiled_from"] == 1  # compiled in step 1 itself
    warmed = [name for name, _ in heard.phases if name.startswith("compile ") and name != "compile"]
    assert warmed, heard.phases
    assert not [step for name, step in heard.phases if name == "compile"], "a step waited for the compiler"


def test_a_warm_pass_shortens_or_pads_only_text_that_follows_the_caption(tiny):
    from lorakit.models.batch import Batch, drop_full_mask
    from lorakit.train.warm import padded_text, shorter_text, text_varies

    qwen = load_adapter("qwen-image", tiny("qwen-image"), dtype=torch.float32)
    flux = load_adapter("flux", tiny("flux"), dtype=torch.float32)
    b = Batch(["k"], torch.zeros(1, 16, 8, 8), {"prompt_embeds": torch.randn(1, 7, 4),
                                               "prompt_embeds_mask": torch.ones(1, 7, dtype=torch.long),
                                               "pooled": torch.zeros(1, 4)}, [])
    assert text_varies(qwen, b)
    short = shorter_text(b)
    assert short.text["prompt_embeds"].shape == (1, 6, 4) and short.text["prompt_embeds_mask"].shape == (1, 6)
    assert torch.equal(short.text["prompt_embeds"], b.text["prompt_embeds"][:, :6])
    assert short.text["pooled"] is b.text["pooled"] and short.latents is b.latents
    padded = Batch(["k"], b.latents, {"prompt_embeds": torch.randn(1, flux.max_sequence_length, 4)}, [])
    assert not text_varies(flux, padded)
    # a batch of two prompts of one length carries no mask; the pass for prompts of different lengths gives it one
    two = drop_full_mask(Batch(["k", "k"], torch.zeros(2, 16, 8, 8), {"prompt_embeds": torch.randn(2, 7, 4),
                                                                     "prompt_embeds_mask": torch.ones(2, 7).long()}, []))
    assert "prompt_embeds_mask" not in two.text
    mixed = padded_text(two)
    assert drop_full_mask(mixed) is mixed  # a mask that masks something: the blocks are called with it
    assert mixed.text["prompt_embeds_mask"].tolist() == [[1] * 6 + [0], [1] * 7]
    assert not mixed.text["prompt_embeds"][0, 6].any() and torch.equal(mixed.text["prompt_embeds"][1],
                                                                         two.text["prompt_embeds"][1])
    assert "prompt_embeds_mask" not in two.text  # the batch it came from is as it was


def test_the_workers_inputs_alias_each_other_as_the_runs_do():
    """FLUX's single blocks take two views of one tensor; the worker's copies stay views of one copy (how inputs
    alias is part of the compiled graph: copied apart, the graphs of symbolic sizes missed those compiled from the
    run's own calls in the compile cache — tiny FLUX with Inductor on the CPU: 12 of 15 graphs, then 15 of 15)."""
    from lorakit.train.compile_bg import _detached

    base = torch.randn(1, 20, 4, requires_grad=True) * 2  # a non-leaf tensor that needs grad, as a block's output
    a, b = base[:, :16], base[:, 16:]
    other = torch.randn(1, 3)
    got = _detached(((a, other), {"b": b, "n": 3}), {})
    (ca, co), kw = got
    cb = kw["b"]
    assert ca._base is cb._base is not None and ca._base is not base  # one copy, both views of it
    assert ca.untyped_storage().data_ptr() == cb.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert (ca.shape, ca.stride(), ca.storage_offset()) == (a.shape, a.stride(), a.storage_offset())
    assert (cb.shape, cb.stride(), cb.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
    assert ca.requires_grad and cb.requires_grad and torch.equal(cb, b.detach()) and torch.equal(co, other)
    assert co._base is None and co.data_ptr() != other.data_ptr() and kw["n"] == 3
    assert describe(torch.nn.Identity(), (a,), {"b": b}) == describe(torch.nn.Identity(), (ca,), {"b": cb})


def test_a_view_in_another_dtype_than_its_base_is_that_view_of_the_copy():
    """Qwen-Image's blocks take the real view of its complex rotary tables: laid over the complex copy with the
    real view's strides, the copy ran past its end (`setStorage: ... out of bounds`, the first step of a Qwen-Image
    run on a GPU, 2026-11-28)."""
    from lorakit.train.compile_bg import _detached

    table = torch.polar(torch.ones(16, 8), torch.randn(16, 8))  # complex64
    whole, tail = torch.view_as_real(table), torch.view_as_real(table[4:])  # float32 views of one complex tensor
    cw, ct = _detached((whole, tail), {})
    for got, want in ((cw, whole), (ct, tail)):
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    assert cw.untyped_storage().data_ptr() == ct.untyped_storage().data_ptr() != table.untyped_storage().data_ptr()
    odd = torch.randn(3, 5, dtype=torch.float64)[:, 1:4].view(torch.float64)  # no other dtype to read it in
    assert torch.equal(_detached(odd, {}), odd)


def test_a_view_made_to_require_grad_itself_is_copied_requiring_it():
    """`train.dims.with_grad` has the first block's inputs require grad; one that is a view of a tensor that does not
    (the checkpointed blocks' inputs) was copied without it: the worker compiled another graph than the run's blocks
    call (Qwen-Image, H200, 2026-11-30: 17.2 s compiling between two steps, then again at step 3)."""
    from lorakit.train.compile_bg import _detached

    base = torch.randn(1, 20, 4)
    view = base[:, 4:].requires_grad_(True)
    (copy,) = _detached((view,), {})
    assert copy.requires_grad and copy._base is not None and torch.equal(copy, view.detach())
    assert describe(torch.nn.Identity(), (view,), {}) == describe(torch.nn.Identity(), (copy,), {})


def test_a_rank_whose_worker_compiled_alone_does_not_hold_up_the_others_load():
    # ranks take their graphs from the cache at one step; a rank whose separate process failed compiles in its
    # worker and then has nothing to take: it must not keep the others waiting for it to the end of the run
    from lorakit.train.compile_bg import BackgroundCompile

    bg = BackgroundCompile.__new__(BackgroundCompile)
    bg.sealed, bg.handed_back, bg.pending = False, False, 3
    assert not bg.lets_others_load  # still compiling (or its process is)
    bg.handed_back = True
    assert bg.lets_others_load  # its graphs wait in the cache
    bg.handed_back, bg.sealed = False, True
    assert bg.lets_others_load  # its worker compiled them itself


def test_the_worker_compiles_under_the_torch_settings_the_runs_thread_made(monkeypatch):
    """torch keeps a setting made in code (the recompile limit `prepare.allow_block_graphs` raises, the compile
    cache's allowance `gpu.compile_cache` makes) for the thread that made it; the worker starts in a copy of that
    thread's context, so it compiles under them (a plain thread saw torch's default limit of 8)."""
    seen = {}

    def record(self):
        seen["limit"] = torch._dynamo.config.recompile_limit

    monkeypatch.setattr(BackgroundCompile, "_work", record)
    blocks = [torch.nn.Linear(4, 4)]
    with torch._dynamo.config.patch(recompile_limit=77):
        bg = BackgroundCompile(blocks, {"backend": "aot_eager"}, "cpu")
    bg._thread.join(timeout=30)
    assert seen == {"limit": 77}
