"""The repeated blocks compiled while training runs (memory.compile_background): the first steps run the blocks
as they are (eager) and a worker thread compiles them meanwhile, on a copy of one block of each kind that shares
the run's weights, for each shape, grad mode and input the blocks meet. Between two steps, once the worker has
compiled all of it, it goes into use; from then on the blocks run the compiled code.

Why it works: torch.compile keeps what it compiles with the block's code, not with the block: a graph compiled for
the copy is found (its guards pass) when the run's blocks of that kind call with the same input shapes, dtypes and
grad requirements, so they never wait for the compiler. Each call's inputs are described (shapes, dtypes, which
require grad, grad mode) and a new description is given to the worker once, with detached copies of the inputs;
the worker runs the compiled copy forward and, where grad is on, backward to the copy's inputs and trainable
weights (`torch.autograd.grad`: the run's gradients are untouched), which compiles both passes. The copy's
trainable weights are new parameters over the same storage, so the optimizer's in-place updates never invalidate
the worker's pass, and no weight memory is duplicated.

The worker begins after the first step (the first `advance` with work given): that step runs alone (beside the
worker a second run's step 1, compiling from the cache, took 4.7 s on the H100).

Which calls run compiled changes only between optimizer steps (`advance`), never inside one (a block's forward and
its recompute run the same code), and once, all together, when the worker has finished everything it was given: the
run's thread never runs compiled code while the worker compiles (torch 2.11's FX tracing flag is global: a compiled
call beside the worker's tracing was refused on the H100). The worker then stops; a later shape compiles in the run.

The cost: while the worker compiles, the run's thread gets the interpreter less often, so the uncompiled steps are
slower than plain eager steps (FLUX.1 1024² on an H100: 0.67-12.9 s against 0.62), host-heavy work between them
more so (a checkpoint's save: 67 s against 3); the run's final saves wait for the compile in progress to end.

On a first run with these settings on the machine the worker first waits for `ahead`, a separate process that
compiles the same calls into the compile cache (`train.precompile`): the uncompiled steps meanwhile have the
interpreter to themselves. Once that process has compiled the training calls, the worker hands its calls back to the
run's thread, which takes their graphs from the cache between two steps, in one phase, and switches; the grid's calls
(eval, no grad) take theirs at the next grid, while the process may still be compiling them. Taken beside the
uncompiled steps, the worker starved them (FLUX.1-dev 1024², fp8 compute, one H200, 2026-11-28: 19 graphs from the
cache in 66.4 s while steps 166-171 took 67 s); in the run's thread, between two steps: 54.5 s.

A description the worker fails to compile (out of memory, say) compiles in the run at its next call (it waits)."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import queue
import threading
import time
from dataclasses import dataclass

from lorakit.train.dims import carry_marks, unwrap_route


def thread_own_fx_patches() -> bool:
    """Make torch.fx's tracer patch `torch.nn.Module.__call__` and `__getattr__` for its own thread only. While it
    traces (AOTAutograd traces each graph through it), the tracer replaces both on the class, for the whole process:
    a module called from another thread meanwhile went through the tracer (on the H100, torch 2.11: the run's eager
    step failed with "module is not installed as a submodule"; a submodule read could come back as the tracer's
    proxy). With this, each replacement calls the tracer's code in the thread that traces and what was there before
    in every other thread. The other patches of a trace (wrapped functions) act only on its proxies. Returns False
    where this torch has no such hook (the blocks then compile in the run). Idempotent."""
    try:
        import torch
        from torch.fx._symbolic_trace import _Patcher
    except ImportError:
        return False
    patch = getattr(_Patcher, "patch_method", None)
    if patch is None:
        return False
    if getattr(patch, "lorakit_thread_own", False):
        return True

    @functools.wraps(patch)
    def patch_method(self, cls, name, new_fn, *args, **kwargs):
        if cls is torch.nn.Module and name in ("__call__", "__getattr__"):
            before, tracer, owner = getattr(cls, name), new_fn, threading.get_ident()

            @functools.wraps(tracer)
            def own(mod, *a, **k):
                return (tracer if threading.get_ident() == owner else before)(mod, *a, **k)

            new_fn = own
        return patch(self, cls, name, new_fn, *args, **kwargs)

    patch_method.lorakit_thread_own = True
    _Patcher.patch_method = patch_method
    return True


def describe(block, args, kwargs) -> tuple:
    """What decides which compiled graph a block's call needs: its kind, train/eval mode, grad, inference and autocast
    modes (each thread has its own) and each input's shape, dtype, device, grad requirement and strides (a view of
    a wider tensor compiles apart), plain values by value."""
    import torch

    cast = tuple((torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cuda", "cpu"))
    return (type(block).__name__, block.training, torch.is_grad_enabled(), _meta(args), _meta(kwargs),
            torch.is_inference_mode_enabled(), cast)


def _meta(v):
    import torch

    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), str(v.dtype), v.device.type, v.requires_grad, v.stride())
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_meta(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((str(k), _meta(x)) for k, x in v.items())))
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__name__


def _detached(v, bases: dict | None = None):
    """The inputs for the worker: each tensor copied (its own memory), detached, with its grad requirement. A view
    stays a view of a copy of its base (inputs that view one tensor view one copy, as in the run): how inputs alias
    each other is part of the graph torch compiles (FLUX's single blocks take two views of one tensor; copied apart,
    their graphs missed the compile process's in the cache once their sizes were symbolic)."""
    import torch

    bases = {} if bases is None else bases
    if isinstance(v, torch.Tensor):
        base = v._base
        if base is not None:
            if id(base) not in bases:
                bases[id(base)] = _copy(base)
            return _view_like(bases[id(base)], v)
        return _copy(v)
    if isinstance(v, (tuple, list)):
        return (tuple if isinstance(v, tuple) else list)(_detached(x, bases) for x in v)
    if isinstance(v, dict):
        return {k: _detached(x, bases) for k, x in v.items()}
    return v


def _view_like(copy, v):
    """`v`'s view (shape, strides, offset, dtype, grad requirement) of `copy`, the copy of its base. A view may have
    another dtype than its base: Qwen-Image's real view (`view_as_real`) of its complex rotary tables, laid over the
    complex copy as it is, ran past its end (`setStorage: ... out of bounds`, H200, 2026-11-28); where the copy cannot
    be reinterpreted in `v`'s dtype, `v` is copied apart (its graph may then miss the compile cache). A view given
    its own grad requirement kept its base's: the run's graphs then missed the compile process's (Qwen-Image with
    checkpointed blocks, H200, 2026-11-30: 17.2 s compiling between two steps, against 7.5 s taking them)."""
    if copy.dtype != v.dtype:
        try:
            copy = copy.view(v.dtype)
        except RuntimeError:
            return _copy(v)
    out = copy.as_strided(v.shape, v.stride(), v.storage_offset())
    return carry_marks(v, out.requires_grad_(True) if v.requires_grad and not out.requires_grad else out)


def _copy(t):
    """A detached copy with the same strides (a view of a wider tensor: compiled graphs are specialised to them)
    and grad requirement."""
    import torch

    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t.detach())
    return carry_marks(t, c.requires_grad_(t.requires_grad) if t.is_floating_point() else c)


def _tensors(v) -> list:
    import torch

    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list, dict)):
        return [t for x in (v.values() if isinstance(v, dict) else v) for t in _tensors(x)]
    return []


def shadow(block):
    """A copy of `block` over the same weights: frozen parameters and buffers are the block's own objects, each
    trainable parameter a new parameter over the same storage (its own version counter)."""
    import torch

    memo = {id(t): t for t in block.buffers()}
    for p in block.parameters():
        memo[id(p)] = torch.nn.Parameter(p.data, requires_grad=True) if p.requires_grad else p
    s = copy.deepcopy(block, memo)
    s._compiled_call_impl = None
    return s


@dataclass
class Ready:
    """A description the worker finished: how long it took, and why it failed (None: compiled)."""

    what: tuple
    seconds: float
    failed: str | None = None
    later: bool = False  # left to its next call (a grid's, from the cache)


class BackgroundCompile:
    """The blocks' calls routed to eager or compiled code; the worker thread that compiles (see the module)."""

    def __init__(self, blocks: list, options: dict, device: str):
        import torch

        self.device = device
        d = torch.device(device)
        self._index = (d.index if d.index is not None else torch.cuda.current_device()) if d.type == "cuda" else None
        self._dead: str | None = None  # why the worker itself stopped (the run then compiles what it meets)
        if not thread_own_fx_patches():  # a trace in the worker would reach the run's modules: the run compiles
            self._dead = "this torch's FX tracer cannot be kept to the worker's thread"
        self.sealed = False  # what the worker compiled is in use, and it has stopped
        self.active: set = set()  # descriptions the blocks run compiled (changed by `advance` only)
        self._seen: set = set()  # descriptions given to the worker
        self._done: list[Ready] = []  # finished by the worker, not yet active (under `_lock`)
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._go = threading.Event()  # set by the first `advance` with work given: step 1 runs alone
        self._made = 0  # graphs the worker compiled in the jobs it finished
        self._started_at: int | None = None  # the process's graph count when the worker's job in progress began
        self.eager_calls = 0  # block calls that ran eager since the last `advance`
        self.failures = 0  # descriptions the worker could not compile (compiled in the run)
        self.pending = 0  # descriptions given to the worker and not yet finished
        self.ahead = None  # train.precompile.Rehearsal: the process compiling into the cache, waited for first
        self.handed_back = False  # set by the worker once `ahead` compiled everything: the run's thread loads them
        self._rendering = threading.Event()  # the run's thread renders a grid (`rendering`): the worker may take them
        self._taking = threading.Lock()  # held by the worker for each call it takes while a grid renders
        self.taken_beside_grid = 0  # training calls the worker took from the cache while a grid rendered
        self._copies: dict = {}  # block kind -> (copy, its compiled call)
        for b in blocks:
            kind = type(b).__name__
            if kind not in self._copies:
                s = shadow(b)
                self._copies[kind] = (s, torch.compile(s._call_impl, **options))
            b._compiled_call_impl = _Route(self, b, torch.compile(b._call_impl, **options))
        self._blocks = blocks
        # in the settings the run's thread made (torch's are per thread: the recompile limit, the compile cache's)
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._work,),
                                        name="lorakit-compile", daemon=True)
        self._thread.start()

    def call(self, block, compiled, args, kwargs):
        what = describe(block, args, kwargs)
        if what in self.active:
            return compiled(*args, **kwargs)
        if (self._dead or self.sealed) and what not in self._seen:  # compiled here, as without a worker (waits)
            self.active.add(what)
            return compiled(*args, **kwargs)
        if what not in self._seen:
            self._seen.add(what)
            self.pending += 1
            bases: dict = {}  # the inputs' views of one tensor stay views of one copy
            self._jobs.put((what, type(block).__name__, _detached(args, bases), _detached(kwargs, bases)))
        self.eager_calls += 1
        return block._call_impl(*args, **kwargs)

    def advance(self, load: bool = False) -> list[Ready]:
        """Between steps: what the worker finished goes into use (a failed one compiles at its next call, in the
        run); `load` (where `loads_now` said so): the calls the worker handed back are taken from the cache here
        first. Returns what went into use now."""
        self.eager_calls = 0
        if self.sealed:
            return []
        if self.pending:  # the first step has run (its kernels, its memory, alone): the worker begins
            self._go.set()
        if self._dead:  # given after the worker stopped: the run compiles them
            left = [Ready(job[0], 0.0, self._dead) for job in self._drain()]
            with self._lock:
                self._done += left
        if load and self.handed_back and self.pending:  # the training graphs are in the cache: taken here, now
            here = [self._compile(job) if job[0][1] else Ready(job[0], 0.0, later=True) for job in self._drain()]
            with self._lock:
                self._done += here
        with self._lock:
            if not self.pending or len(self._done) < self.pending:
                return []  # all or nothing: the worker is still compiling (or has been given nothing yet)
            done, self._done = self._done, []
        for r in done:
            self.active.add(r.what)
        self.failures += sum(1 for r in done if r.failed)
        self.pending, self.sealed = 0, True
        self.close(ahead=False)  # idle: it stops (what the run meets from now on compiles in the run)
        for b in self._blocks:  # the blocks call their compiled code directly: no description per call from now on
            unwrap_route(b)
        return done

    @property
    def loads_now(self) -> bool:
        """Will the next `advance` take the graphs from the cache in the run's thread (a phase of its own)? Not where
        the worker took them all while a grid rendered (`rendering`)."""
        return self.handed_back and bool(self.pending) and not self.sealed and not self._jobs.empty()

    @contextlib.contextmanager
    def rendering(self):
        """The run's thread renders a grid (uncompiled block calls, GPU-bound): where the separate process has the
        training graphs in the cache meanwhile, the worker takes them there, in its thread, instead of the run's thread
        after the grid, between two steps (Qwen-Image 1024², one H200, 2026-11-30: 3.8 s after the 39.0 s step-0 grid,
        its graph compiled 20.8 s into it). A grid's calls wait for the GPU far longer than they hold the interpreter.
        Each call the worker begins is finished before the grid's end returns (the run's thread then never runs the
        compiled code beside the worker's tracing); the rest, and the grid's own calls, are left to `advance`. Only
        where a separate process compiles (`ahead`): a worker compiling beside a grid would hold the interpreter."""
        if self.sealed or not self.pending or self.ahead is None or self._dead:
            yield
            return
        self._rendering.set()
        self._go.set()  # step 1 has run: the worker begins (it waits for the process first)
        try:
            yield
        finally:
            self._rendering.clear()
            with self._taking:  # the call in progress, finished
                pass
            if self.handed_back:  # the grid's own calls (eval) take theirs at the next grid; the training calls
                left = self._drain()  # not taken yet are the run's thread's (`advance`)
                with self._lock:
                    self._done += [Ready(job[0], 0.0, later=True) for job in left if not job[0][1]]
                for job in (job for job in left if job[0][1]):
                    self._jobs.put(job)

    @property
    def lets_others_load(self) -> bool:
        """Data parallel ranks take their graphs from the cache at the same step (`train.loop`): can the others
        take theirs now without waiting for this rank in the next all-reduce? Where its own graphs wait in the cache
        too (or were taken while a grid rendered), or it has nothing left to take (its worker compiled them: its
        separate process failed)."""
        return self.sealed or (self.handed_back and bool(self.pending))

    @property
    def failed(self) -> bool:
        """Did the worker fail anything (those shapes compiled in the run instead)?"""
        return bool(self._dead) or self.failures > 0

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def own_graphs(self) -> int:
        """Graphs compiled in the process so far that the worker did not compile (a step that made one waited)."""
        from torch._dynamo.utils import counters

        with self._lock:  # a job in progress: its graphs so far are the worker's too
            now = int(counters["stats"]["unique_graphs"])
            return (now if self._started_at is None else self._started_at) - self._made

    def close(self, ahead: bool = True) -> None:
        """Stop the worker: what it has not begun is dropped, the compile it is in finishes (a process that exits
        while the compiler runs in a thread aborts); `ahead`: the separate process too (else it goes on with the
        grid's graphs). Called again, it returns at once."""
        alive = self._thread.is_alive()
        if alive:
            self._drain()
            self._jobs.put(None)
        if self.ahead and ahead:  # the worker may be waiting for it: it then finds nothing to begin
            self.ahead.close()
        if alive:
            self._go.set()
            self._thread.join()

    def _drain(self) -> list:
        """The jobs given and not begun, taken off the queue."""
        jobs = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _work(self) -> None:
        try:
            self._jobs_loop()
        except BaseException as e:  # noqa: BLE001 - the worker itself failed: what it was given compiles in the run
            self._dead = f"{type(e).__name__}: {e}"
            left = [Ready(job[0], 0.0, self._dead) for job in self._drain()]
            with self._lock:
                self._started_at = None
                self._done += left

    def _jobs_loop(self) -> None:
        import torch

        if self._index is not None:
            torch.cuda.set_device(self._index)
        self._go.wait()
        if self.ahead:  # its graphs are compiled in a separate process first
            if self.ahead.wait(training=True).get("ok"):  # the run's thread takes them from the cache (`advance`)
                self.handed_back = True
                self._take_while_rendering()
                return
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ready = self._compile(job)
            with self._lock:
                self._done.append(ready)

    def _take_while_rendering(self) -> None:
        """The training calls taken from the cache here, one at a time, while the run's thread renders a grid."""
        while True:
            with self._taking:
                if not self._rendering.is_set():
                    return
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job is None:  # `close`
                    return
                ready = self._compile(job) if job[0][1] else Ready(job[0], 0.0, later=True)
                with self._lock:
                    self._done.append(ready)
                    self.taken_beside_grid += 0 if ready.later else 1

    def _compile(self, job) -> Ready:
        """One description compiled (or taken from the cache): the copy's compiled call, forward and, where grad is
        on, backward, on the job's inputs. In the worker's thread, or the run's once the worker handed back."""
        import torch
        from torch._dynamo.utils import counters

        what, kind, args, kwargs = job
        copy_, compiled = self._copies[kind]
        with self._lock:
            self._started_at = int(counters["stats"]["unique_graphs"])
        t0, failed = time.perf_counter(), None
        try:
            copy_.train(what[1])
            cast = [torch.autocast(d, dtype=getattr(torch, dt.split(".")[-1]), enabled=on)
                    for d, (on, dt) in zip(("cuda", "cpu"), what[6], strict=True)]
            with torch.inference_mode(what[5]), torch.set_grad_enabled(what[2]), cast[0], cast[1]:
                out = compiled(*args, **kwargs)
                outs = [o for o in _tensors(out) if o.requires_grad]
                if outs:  # the backward pass compiles at its first call: make it here
                    wrt = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                    wrt += [p for p in copy_.parameters() if p.requires_grad]
                    torch.autograd.grad(sum(o.float().sum() for o in outs), wrt, allow_unused=True)
            del out, outs
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the run compiles this one itself at its next call
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        del args, kwargs
        with self._lock:
            self._made += int(counters["stats"]["unique_graphs"]) - self._started_at
            self._started_at = None
        return Ready(what, time.perf_counter() - t0, failed)


class _Route:
    """A block's `_compiled_call_impl`: the block's call goes through `BackgroundCompile.call`."""

    def __init__(self, owner: BackgroundCompile, block, compiled):
        self.owner, self.block, self.compiled = owner, block, compiled

    def __call__(self, *args, **kwargs):
        return self.owner.call(self.block, self.compiled, args, kwargs)
