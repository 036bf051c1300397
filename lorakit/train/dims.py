"""The blocks' sizes that vary with the data, symbolic in their compiled graphs from the first compile.

A compiled block holds graphs specialised to the sizes of the inputs it met. At the second value of a size torch
compiles it again, that size symbolic (a graph for any value): a run with three bucket shapes (and, for families
whose text length follows the caption, other text lengths) compiled each block twice before its steps were steady —
FLUX.1-dev 1024² on an H100 (2026-11-25): step 1 compiling 39.3 s, the other shapes 41.7 s; Qwen-Image at 24 GiB on
one H200 (2026-11-29): 40.0 s, then 90.2 s. The second graph, symbolic in what varies, serves every shape; the first
one is met once.

Before step 1, `varying` runs the transformer once (no gradients, the blocks uncompiled) on one batch of each bucket
shape and text length the run will meet, records the first call of each block kind, and compares: the dimensions of
the blocks' inputs whose sizes differ are the ones that vary. `install` marks them symbolic (torch's
`maybe_mark_dynamic`, a hint torch drops where the code needs the size fixed) at each call of a compiled block, so the
first compile makes the graph the second one would have made and no shape of the data compiles again. Where nothing
varies (one bucket, a fixed text length) nothing is marked: the graphs stay specialised, as before.

Measured (2026-11-30): Qwen-Image at 24 GiB on one card of a 2x H200 host, three bucket shapes, captions of their own
lengths: the other shapes after step 1 took 2.4 s and no new graph (90.2 s before). Where Inductor keeps a property of
a symbolic size fixed, data with both kinds still compiles twice: FLUX.1's attention lowering guards on 512 + the image
tokens being a multiple of 8 (848x1232: 4081 tokens, 1024²: 4096), one graph for each — `data.buckets` makes every
bucket's token count a multiple of 8 for that reason.

The same pass finds the inputs each block carries on from the block before it (`carried`: a tensor of the previous
block's output, not passed through from its input — the image and text streams, not the timestep nor, in a
cross-attention model, the text). With LoRA the first block of a list gets them from frozen embedders, without
gradients, where every later block gets them with: two graphs (forward and backward) for the same block code, which
doubled the compile — Qwen-Image on an H200 (2026-11-30): the separate process compiled 2 graphs in 47.7 s, the run
took 4 from the cache in 7.5 s. `install` has a block holding trained weights take those inputs as requiring
gradients (a leaf's flag: the backward then also computes the gradient of that block's inputs, a few matrix
products of one block, and stops there), so every block of the kind calls one graph.

Where a kind's later calls take those inputs as views of one tensor (FLUX.1's single blocks: the text and image streams
are two slices of the previous block's output) and its first call as separate tensors (the last double block's two
outputs), the strides differ and the kind compiled two graphs for one code. `packs` records, per kind, the dimension
along which the later calls' views lie side by side; `install` has a call whose inputs arrive apart join them along it
first (one copy of the two streams) and pass the slices, so every call of the kind meets the same layout. FLUX.1-dev,
first run on one card of a 2x H200 host (2026-11-30): the compile process's training graphs took 31.7 s (59.4 s that
morning), the run compiled from step 26 (69), its 300-step LoRA file at 208.9 s (243.6)."""

from __future__ import annotations

import functools
import inspect

from lorakit.train.swap import repeated_blocks

MARKS = ("_dynamo_", "_has_dynamo_")  # the names of the attributes torch keeps a tensor's marked dims in


def _tensors(v, path=()) -> dict:
    """Each tensor among a call's inputs (or outputs): its path (positions and keyword names) -> the tensor."""
    import torch

    if isinstance(v, torch.Tensor):
        return {path: v}
    if isinstance(v, (tuple, list)):
        return {p: t for i, x in enumerate(v) for p, t in _tensors(x, path + (i,)).items()}
    if isinstance(v, dict):
        return {p: t for k, x in v.items() for p, t in _tensors(x, path + (str(k),)).items()}
    return {}


def _shapes(v) -> dict:
    return {p: tuple(t.shape) for p, t in _tensors(v).items()}


def _storages(v) -> set:
    return {t.untyped_storage().data_ptr() for t in _tensors(v).values() if t.is_floating_point()}


def differing(calls: list[dict]) -> tuple[tuple[tuple, int], ...]:
    """(path, dim) of each input dimension whose size is not the same in every call (a path missing from a call, or
    of another rank, is left as it is: a mask present in one call only is a graph of its own anyway)."""
    out = []
    for path, shape in calls[0].items():
        others = [c.get(path) for c in calls[1:]]
        if any(o is None or len(o) != len(shape) for o in others):
            continue
        out += [(path, d) for d, n in enumerate(shape) if any(o[d] != n for o in others)]
    return tuple(out)


def varying(tr, batches: list, carried: dict | None = None,
            packs: dict | None = None) -> dict[str, tuple[tuple[tuple, int], ...]]:
    """Block kind -> the (path, dim) of its inputs that differ over these batches of the run (`found`, one forward of
    each at sigma 0.5 with noise from its own generator; fewer than two batches: none), and into `carried` the
    inputs each kind carries on from the block before (into `packs`: how its later calls take them, `found`)."""
    import torch

    if not batches:
        return {}
    gen = torch.Generator().manual_seed(0)

    def forward(batch):
        n = batch.latents.shape[0]
        return lambda: tr.loss_on(batch, torch.full((n,), 0.5), torch.randn(batch.latents.shape, generator=gen))

    return found(tr.transformer, [forward(b) for b in batches], tr.device, carried, packs)


def _contiguous(shape) -> tuple:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def tiling(ts: list) -> int | None:
    """The dimension along which these tensors (in this order) lie side by side in one storage, filling a contiguous
    tensor from its start — as `torch.cat` along it and a split back would leave them — or None."""
    t0 = ts[0]
    if len(ts) < 2 or t0.storage_offset() or any(
            t.dim() != t0.dim() or t.dtype != t0.dtype or t.stride() != t0.stride() or
            t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() for t in ts):
        return None
    for d in range(t0.dim()):
        rest = [tuple(t.shape[:d]) + tuple(t.shape[d + 1:]) for t in ts]
        whole = list(t0.shape)
        whole[d] = sum(t.shape[d] for t in ts)
        if any(r != rest[0] for r in rest) or tuple(t0.stride()) != _contiguous(whole):
            continue
        offsets = [sum(t.shape[d] for t in ts[:i]) * t0.stride(d) for i in range(len(ts))]
        if [t.storage_offset() for t in ts] == offsets:
            return d
    return None


def found(transformer, passes: list, device: str, carried: dict | None = None,
          packs: dict | None = None) -> dict[str, tuple[tuple[tuple, int], ...]]:
    """Block kind -> the (path, dim) of its inputs whose sizes differ between these passes through the transformer
    (each run once without gradients, the blocks uncompiled; the random states and gradients as before), from the
    first call of each kind in each pass. Kinds where nothing differs are left out. Into `carried`: block kind -> the
    paths of the inputs its calls took from the previous block call's outputs (and not from that call's inputs). Into
    `packs`: block kind -> (dim, names) where some of its calls took those inputs (named parameters) as slices of one
    tensor along dim, in that order (`tiling`), and others as separate tensors."""
    import torch

    blocks = repeated_blocks(transformer)
    seen: dict[str, list[dict]] = {}
    first: dict[str, dict] = {}
    before = {"in": set(), "out": set()}  # the storages of the previous block call's inputs and outputs
    took: dict[str, set] = {}
    tiled: dict[str, tuple] = {}
    apart: set = set()

    def hook(block, args, kwargs):
        inputs = named(block, args, kwargs)
        kind = type(block).__name__
        first.setdefault(kind, _shapes(inputs))
        new = before["out"] - before["in"]  # made by the previous call, not handed through it
        got = {p: t for p, t in _tensors(inputs).items()
               if t.is_floating_point() and t.untyped_storage().data_ptr() in new}
        if got:
            took.setdefault(kind, set()).update(got)
        if len(got) > 1 and all(len(p) == 1 and isinstance(p[0], str) for p in got):
            order = sorted(got, key=lambda p: (got[p].untyped_storage().data_ptr(), got[p].storage_offset()))
            d = tiling([got[p] for p in order])
            if d is not None:
                tiled.setdefault(kind, (d, tuple(p[0] for p in order)))
            elif len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got):
                apart.add(kind)
        before["in"] = _storages(inputs)

    def after(block, args, kwargs, output):
        before["out"] = _storages(output)

    impls = [b._compiled_call_impl for b in blocks]
    hooks = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    hooks += [b.register_forward_hook(after, with_kwargs=True) for b in blocks]
    cpu_rng = torch.random.get_rng_state()
    cuda = device.startswith("cuda")
    cuda_rng = torch.cuda.get_rng_state(torch.device(device)) if cuda else None
    try:
        for b in blocks:
            b._compiled_call_impl = None  # eager: the hooks see the calls, nothing compiles
        with torch.no_grad():
            for run in passes:
                first.clear()
                run()
                for kind, shapes in first.items():
                    seen.setdefault(kind, []).append(shapes)
    finally:
        for b, impl in zip(blocks, impls, strict=True):
            b._compiled_call_impl = impl
        for h in hooks:
            h.remove()
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, torch.device(device))
    if carried is not None:
        carried.update({kind: tuple(sorted(paths, key=str)) for kind, paths in took.items()})
    if packs is not None:
        packs.update({kind: pack for kind, pack in tiled.items() if kind in apart})
    dims = {kind: differing(calls) for kind, calls in seen.items() if len(calls) == len(passes) > 1}
    return {kind: d for kind, d in dims.items() if d}


def _at(v, path):
    for p in path:
        try:
            v = v[p]
        except (IndexError, KeyError, TypeError):
            return None
    return v


@functools.cache
def _params(cls) -> tuple[str, ...]:
    """The names `cls.forward` takes by position, in order (`self` and any `*args`/`**kwargs` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(n for n, p in inspect.signature(cls.forward).parameters.items() if p.kind in kinds)[1:]


def named(block, args, kwargs) -> dict:
    """A block call's inputs by the names of its `forward`'s parameters: the same whether they came by position
    (diffusers' gradient checkpointing passes them so) or by keyword (its calls without gradients)."""
    return {**dict(zip(_params(type(block)), args, strict=False)), **kwargs}


def mark(block, args, kwargs, dims) -> None:
    """Mark these (path, dim) of a block call's inputs symbolic for torch.compile."""
    _mark(named(block, args, kwargs), dims)


def _mark(inputs: dict, dims) -> None:
    import torch

    for path, d in dims:
        t = _at(inputs, path)
        if isinstance(t, torch.Tensor) and d < t.dim() and t.shape[d] > 1:  # torch keeps sizes 0 and 1 fixed
            torch._dynamo.maybe_mark_dynamic(t, d)


def carry_marks(src, dst):
    """`dst` (a copy of `src`) with `src`'s marks (the background compile's copies of a call's inputs): the
    attributes torch keeps them in (`_dynamo_weak_dynamic_indices`, ..., and `_has_dynamo_dim_marking`)."""
    for attr, v in getattr(src, "__dict__", {}).items():
        if attr.startswith(MARKS):
            setattr(dst, attr, set(v) if isinstance(v, set) else v)
    return dst


def with_grad(inputs: dict, paths) -> None:
    """In a training call with gradients: these inputs (leaves without gradients: the first block's, from frozen
    embedders) require them, as every later block's do."""
    import torch

    for path in paths:
        t = _at(inputs, path)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.is_leaf and not t.requires_grad:
            t.requires_grad_(True)


def settled(t):
    """`t` with the stride of each of its size-1 dimensions as a contiguous tensor of its sizes would have it (the
    same elements: a size-1 dimension's stride addresses nothing). A slice's stride there is its whole tensor's size
    times the rest, which changes with another bucket shape where the slice's own sizes do not (the text stream of
    FLUX.1's single blocks): torch.compile keeps such a stride fixed until it has seen it change, a graph more."""
    for i in reversed(range(t.dim())):  # from the innermost: each such stride follows the one inside it
        if t.shape[i] == 1 and t.stride(i) != (t.stride(i + 1) * t.shape[i + 1] if i + 1 < t.dim() else 1):
            t = t.squeeze(i).unsqueeze(i)
    return t


def packed(block, args, kwargs, inputs: dict, pack) -> tuple[tuple, dict]:
    """The call's args and kwargs with the inputs `pack` names (dim, names) joined along dim and passed as slices of
    the joined tensor, as the kind's later calls get them; unchanged where they are slices of one tensor already (or
    cannot be joined). `inputs` (`named`'s) is updated alike."""
    import torch

    d, names = pack
    ts = [inputs.get(n) for n in names]
    if not all(isinstance(t, torch.Tensor) for t in ts) or len({(t.dtype, t.device) for t in ts}) > 1:
        return args, kwargs
    views = ts if len({t.untyped_storage().data_ptr() for t in ts}) == 1 else \
        torch.cat(ts, dim=d).split([t.shape[d] for t in ts], dim=d)
    views = [settled(v) for v in views]
    if all(v is t for v, t in zip(views, ts, strict=True)):
        return args, kwargs
    args, kwargs, params = list(args), dict(kwargs), _params(type(block))
    for n, v in zip(names, views, strict=True):
        inputs[n] = v
        if n in kwargs or n not in params or params.index(n) >= len(args):
            kwargs[n] = v
        else:
            args[params.index(n)] = v
    return tuple(args), kwargs


class Marked:
    """A block's `_compiled_call_impl`: has its carried inputs require gradients (`with_grad`), passes those its
    kind's later calls take as slices of one tensor so (`packed`), marks the call's varying dims, then calls what it
    wraps (`inner`)."""

    def __init__(self, block, inner, dims, carried=(), pack=None):
        self.block, self.inner, self.dims, self.carried, self.pack = block, inner, dims, carried, pack

    def __call__(self, *args, **kwargs):
        args, kwargs = self.prepared(args, kwargs)
        return self.inner(*args, **kwargs)

    def prepared(self, args, kwargs) -> tuple[tuple, dict]:
        """The call's args and kwargs as the compiled code gets them (also where a recomputed block's call goes to
        the function compiled with its checkpoint: `train.prepare.checkpoint_blocks`)."""
        import torch

        grads = self.carried and torch.is_grad_enabled() and self.block.training
        if self.dims or grads or self.pack:
            inputs = named(self.block, args, kwargs)  # once per call: on every block call of the run
            if grads:
                with_grad(inputs, self.carried)
            if self.pack:
                args, kwargs = packed(self.block, args, kwargs, inputs, self.pack)
            _mark(inputs, self.dims)
        return args, kwargs


def install(transformer, dims: dict, carried: dict | None = None, packs: dict | None = None) -> int:
    """Wrap each compiled block whose kind has varying dims, a pack (`packed`), or carried inputs and trained weights
    of its own; returns how many blocks were wrapped."""
    n = 0
    for b in repeated_blocks(transformer):
        kind = type(b).__name__
        d, p = dims.get(kind, ()), (packs or {}).get(kind)
        c = (carried or {}).get(kind, ()) if any(q.requires_grad for q in b.parameters()) else ()
        impl = b._compiled_call_impl
        if (d or c or p) and impl is not None and not isinstance(impl, Marked):
            b._compiled_call_impl = Marked(b, impl, d, c, p)
            n += 1
    return n


def unwrap_route(block) -> None:
    """After the background compile: the block calls its compiled code directly, still marked where it was."""
    impl = block._compiled_call_impl
    if isinstance(impl, Marked):
        impl.inner = impl.inner.compiled
    else:
        block._compiled_call_impl = impl.compiled


def _name(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def said(dims: dict) -> str:
    """The varying dims in words, for the log."""
    return "; ".join(f"{kind}: " + ", ".join(f"{_name(p)} dim {d}" for p, d in ds) for kind, ds in dims.items())


def said_carried(carried: dict) -> str:
    """The carried inputs in words, for the log."""
    return "; ".join(f"{kind}: " + ", ".join(_name(p) for p in ps) for kind, ps in carried.items())


def said_packs(packs: dict) -> str:
    """The packed inputs in words, for the log."""
    return "; ".join(f"{kind}: " + " + ".join(names) + f" along dim {d}" for kind, (d, names) in packs.items())


def to_json(dims: dict, carried: dict | None = None, packs: dict | None = None) -> dict:
    return {"dims": {kind: [[list(p), d] for p, d in ds] for kind, ds in dims.items()},
            "carried": {kind: [list(p) for p in ps] for kind, ps in (carried or {}).items()},
            "packs": {kind: [d, list(names)] for kind, (d, names) in (packs or {}).items()}}


def from_json(data: dict) -> tuple[dict, dict, dict]:
    """`to_json`'s inverse: (dims, carried, packs)."""
    data = data or {}
    return ({kind: tuple((tuple(p), d) for p, d in ds) for kind, ds in data.get("dims", {}).items()},
            {kind: tuple(tuple(p) for p in ps) for kind, ps in data.get("carried", {}).items()},
            {kind: (d, tuple(names)) for kind, (d, names) in data.get("packs", {}).items()})
