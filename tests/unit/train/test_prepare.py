"""Turning a loaded transformer into what a run trains: partial gradient checkpointing."""

import pytest
import torch

from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train.prepare import checkpoint_blocks
from lorakit.train.swap import repeated_blocks


def test_only_the_first_n_blocks_recompute_and_the_gradients_are_the_same(tiny, monkeypatch):
    family = "flux"
    folder = tiny(family)
    adapter = load_adapter(family, folder, dtype=torch.float32)
    batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                   torch.Generator().manual_seed(0))
    recomputed = []
    stock = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kw):
        recomputed.append(fn.__self__)
        return stock(fn, *args, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    grads = {}
    for n in (None, 1, 0):
        tr = load_component(folder / "transformer", "cpu", torch.float32).train()
        tr.x_embedder.weight.requires_grad_(True)  # a parameter before every block: gradients flow through all
        blocks = repeated_blocks(tr)
        assert len(blocks) > 1
        assert checkpoint_blocks(tr, n) == (len(blocks) if n is None else n)
        recomputed.clear()
        x = batch.latents.clone()
        v = adapter.predict(tr, x, torch.tensor([0.6]), batch.text)
        v.square().mean().backward()
        assert recomputed == (blocks if n is None else blocks[:n])
        grads[n] = tr.x_embedder.weight.grad
    torch.testing.assert_close(grads[1], grads[None], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0], grads[None], rtol=1e-5, atol=1e-7)


# the ways one class of block is called, where a family calls it more than one way: Z-Image's refiners run its block
# over the image tokens (modulated) and over the text tokens (unmodulated) before its layers run it over both
CALL_KINDS = {"z-image": 3}
# Z-Image's fp8 products round per token a little apart compiled and eager: up to 3.7e-4 on 1% of its LoRA gradients'
# elements (torch 2.14.1, aot_eager; equal with bf16 products, 2026-12-01)
GRAD_ATOL = {"z-image": 5e-4}


def _flat_grads(params):
    """Every trained weight's gradient in one vector (zeros where none reached a weight)."""
    return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).flatten() for q in params])


@pytest.mark.slow
@pytest.mark.parametrize("family, device", [("qwen-image", "cpu"), ("flux", "cpu"), ("wan2.1-t2v", "cpu"), ("z-image", "cpu"),
                                            pytest.param("qwen-image", "cuda", marks=pytest.mark.gpu)])
def test_compiled_recompute_keeps_only_each_blocks_inputs_and_gives_the_same_gradients(tiny, family, device,
                                                                                          monkeypatch):
    """memory.compiled_recompute on the small cards' storage (8-bit base, fp8 products, bf16 under autocast as a
    GPU run): each recomputed block's call is one compiled function whose forward keeps nothing for backward but
    the block's inputs, weights and buffers (the recompute is in its backward graph), and the LoRA's gradients are
    the eager checkpoint's. On a GPU with Inductor, as runs compile: torch 2.11 kept the 8-bit products computed
    inside an autograd Function (2026-12-01, docs/benchmarks-history.md). It is the default wherever compiled
    blocks recompute, so each kind of block is checked: Qwen-Image's, FLUX's two (the single blocks' joined
    streams), Wan's, Z-Image's three calls of one class."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo import lookup_backend, reset

    from lorakit.dist import Dist
    from lorakit.plan.resolve import resolve
    from lorakit.train import dims
    from lorakit.train.prepare import prepare

    folder = tiny(family)
    cfg = resolve({"profile": "cpu", "model": {"family": family, "path": str(folder)},
                   "memory": {"base_quant": "qfloat8", "compute": "fp8", "gradient_checkpointing": True}},
                  paths=()).cfg
    adapter = load_adapter(family, folder, device=device, dtype=torch.bfloat16)
    grads, kept = {}, []
    joined = set()  # FLUX's first single block gets its two streams joined into one tensor: still its inputs
    stock = dims.packed

    def packed(*a, **kw):
        args, kwargs = stock(*a, **kw)
        joined.update(t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()]
                      if isinstance(t, torch.Tensor))
        return args, kwargs

    monkeypatch.setattr(dims, "packed", packed)
    for together in (False, True):
        reset()  # the graphs counted are this pass's: nothing of what this process compiled before
        torch.manual_seed(0)  # (the same block code and `_checkpointed`, other sizes) weighs on them
        p = prepare(cfg, adapter, load_component(folder / "transformer"), device, torch.bfloat16, Dist())
        tr = p.transformer
        for q in p.params:  # LoRA's B starts at zero: give every trained weight a gradient to compare
            torch.nn.init.normal_(q, std=0.02)
        blocks = repeated_blocks(tr)
        inner = lookup_backend("aot_eager" if device == "cpu" else "inductor")  # Inductor on a GPU
        made = []  # the graphs compiled here (torch's counters are the whole process's)

        def counted(gm, example_inputs, inner=inner, made=made):
            made.append(gm)
            return inner(gm, example_inputs)
        options = {"backend": counted}
        assert checkpoint_blocks(tr, None, compiled=options if together else None) == len(blocks)
        func = tr._gradient_checkpointing_func

        def watched(block, *args, func=func, together=together):
            own = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), *args]
                   if isinstance(t, torch.Tensor)}
            own |= {t.untyped_storage().data_ptr() for a in args if isinstance(a, tuple) for t in a}

            def pack(t, together=together):
                if t.is_floating_point() and t.untyped_storage().data_ptr() not in own | joined:  # not the RNG's
                    kept.append((together, tuple(t.shape)))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return func(block, *args)

        tr._gradient_checkpointing_func = watched
        batch = adapter.example_inputs(dict(tr.config), 64, 8, torch.Generator().manual_seed(0))
        text = {k: v.to(device) for k, v in batch.text.items()}

        def forward(tr=tr, batch=batch, text=text):
            with torch.autocast(device, dtype=torch.bfloat16):
                return adapter.predict(tr, batch.latents.to(device, torch.bfloat16),
                                       torch.tensor([0.6], device=device), text)

        if together:  # as a run: the blocks compiled, their calls prepared by train.dims (carried inputs)
            tr.compile_repeated_blocks(**options)
            carried, packs = {}, {}
            dims.install(tr, dims.found(tr, [forward], device, carried, packs), carried, packs)
            assert carried
        made.clear()
        forward().float().square().mean().backward()
        # one graph for every block: the first block's carried inputs take gradients as the others' do
        kinds = CALL_KINDS.get(family, len({type(b) for b in blocks}))
        assert len(made) == (kinds if together else 0)
        # None where nothing reached a weight (the last block's text output is unused), zeros when compiled
        grads[together] = _flat_grads(p.params)
    assert [k for k in kept if k[0]] == []  # compiled together: nothing of a block's own kept for backward
    torch.testing.assert_close(grads[True], grads[False], rtol=0.02, atol=GRAD_ATOL.get(family, 1e-4))


def test_an_unresolved_compiled_recompute_over_swapped_blocks_is_refused(tiny):
    """The compiled recompute calls a block's forward without its hooks (the swapper's copies in and out): `resolve`
    turns it off there with its reason, and `prepare` refuses a config that did not pass through it."""
    from lorakit.dist import Dist
    from lorakit.plan.resolve import resolve
    from lorakit.train.prepare import prepare

    folder = tiny("flux")
    cfg = resolve({"profile": "cpu", "model": {"family": "flux", "path": str(folder)}}, paths=()).cfg
    cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={
        "compile": True, "compiled_recompute": True, "blocks_to_swap": 1, "pin_memory": False})})
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    with pytest.raises(ValueError, match="compiled_recompute with swapped or sharded blocks"):
        prepare(cfg, adapter, load_component(folder / "transformer"), "cpu", torch.float32, Dist())


def test_the_cpp_wrapper_reaches_every_compile_of_the_blocks_and_routes_cudnn_attention(tiny, monkeypatch):
    """memory.cpp_wrapper, as resolved: the blocks' own compile and the compiled recompute's get Inductor's
    cpp_wrapper option and lorakit's cuDNN operators are in use (registered before either compiles); off, neither."""
    from lorakit.dist import Dist
    from lorakit.hardware import cudnn_op
    from lorakit.plan.resolve import resolve
    from lorakit.train.prepare import cpp_wrapper_options, prepare

    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: asked.append((getattr(fn, "__qualname__", ""), kw)) or fn)
    monkeypatch.setattr(cudnn_op, "ops", lambda: asked.append("registered"))
    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    base = resolve({"profile": "cpu", "model": {"family": "flux", "path": str(folder)},
                    "memory": {"gradient_checkpointing": True}}, paths=()).cfg
    try:
        for cpp in (True, False):
            asked.clear()
            cfg = base.model_copy(update={"memory": base.memory.model_copy(update={
                "compile": True, "compiled_recompute": True, "compile_background": False, "cpp_wrapper": cpp})})
            prepare(cfg, adapter, load_component(folder / "transformer"), "cpu", torch.float32, Dist())
            # the recompute's, then each block's own (libraries imported meanwhile compile helpers of their own)
            compiles = [kw for name, kw in (a for a in asked if isinstance(a, tuple))
                        if name in ("_checkpointed", "Module._call_impl")]
            assert len(compiles) == 1 + len(repeated_blocks(load_component(folder / "transformer")))
            assert all(kw.get("options") == (cpp_wrapper_options() if cpp else None) for kw in compiles)
            assert cudnn_op.ROUTE[0] is cpp and (asked.index("registered") < asked.index(next(
                a for a in asked if isinstance(a, tuple) and a[0] == "_checkpointed")) if cpp else
                "registered" not in asked)
    finally:
        cudnn_op.use(False)


@pytest.mark.gpu
@pytest.mark.parametrize("stored", [torch.bfloat16, None])
def test_blocks_launched_from_cpp_run_their_compiled_backward_and_give_the_eager_gradients(tiny, stored):
    """memory.cpp_wrapper with the compiled recompute, as a run prepares it on a GPU (tiny Qwen-Image under bf16
    autocast, the small cards' 8-bit base and fp8 products, cuDNN attention as the run puts it in force, Inductor):
    the backward graph, compiled when first called, builds its C++ launch code and the LoRA's gradients are the
    eager checkpoint's. With Inductor's `cpp_wrapper` option alone torch 2.11 failed there, in the backward's
    compile ("CudaKernelParamCache not populated for triton_...", 2026-12-02). Loaded in bf16 as a run loads it,
    and as stored (fp32 norms: a query that reaches attention in fp32, cast by autocast)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo import reset

    from lorakit.dist import Dist
    from lorakit.hardware import cudnn_op, sdpa
    from lorakit.plan.resolve import resolve
    from lorakit.train.prepare import prepare

    folder = tiny("qwen-image")
    base = resolve({"profile": "cpu", "model": {"family": "qwen-image", "path": str(folder)},
                    "memory": {"base_quant": "qfloat8", "compute": "fp8", "gradient_checkpointing": True}},
                   paths=()).cfg
    adapter = load_adapter("qwen-image", folder, device="cuda", dtype=torch.bfloat16)
    grads, prev = {}, sdpa.apply("cudnn", fallback=True)
    try:
        for cpp in (False, True):
            reset()
            cfg = base.model_copy(update={"memory": base.memory.model_copy(update={
                "compile": cpp, "compiled_recompute": cpp, "compile_background": False, "cpp_wrapper": cpp})})
            torch.manual_seed(0)
            p = prepare(cfg, adapter, load_component(folder / "transformer", dtype=stored), "cuda", torch.bfloat16,
                        Dist())
            for q in p.params:  # LoRA's B starts at zero: give every trained weight a gradient to compare
                torch.nn.init.normal_(q, std=0.02)
            batch = adapter.example_inputs(dict(p.transformer.config), 64, 8, torch.Generator().manual_seed(0))
            for _ in range(2):  # the second pass runs the compiled code built by the first
                for q in p.params:
                    q.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = adapter.predict(p.transformer, batch.latents.to("cuda", torch.bfloat16),
                                          torch.tensor([0.6], device="cuda"),
                                          {k: v.to("cuda") for k, v in batch.text.items()})
                out.float().square().mean().backward()
            assert cudnn_op.ROUTE[0] is cpp
            grads[cpp] = _flat_grads(p.params)
    finally:
        cudnn_op.use(False)
        sdpa.restore(prev)
        reset()
    torch.testing.assert_close(grads[True], grads[False], rtol=0.02, atol=GRAD_ATOL.get("qwen-image", 1e-4))


def test_the_preparation_says_what_each_part_took(tiny):
    from lorakit.dist import Dist
    from lorakit.plan.resolve import resolve
    from lorakit.train.prepare import prepare

    folder = tiny("flux")
    cfg = resolve({"profile": "cpu", "model": {"family": "flux", "path": str(folder)},
                   "memory": {"base_quant": "fp8", "gradient_checkpointing": True}}, paths=()).cfg
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    p = prepare(cfg, adapter, load_component(folder / "transformer"), "cpu", torch.float32, Dist())
    assert list(p.took) == ["8-bit base", "the rest placed", "LoRA", "checkpointing, trained weights"]
    assert all(isinstance(v, float) and v >= 0 for v in p.took.values()) and p.quantized > 0


def _sharded_steps(rank, world, store, folder, out):
    """One rank: the tiny FLUX transformer under FSDP2 (gloo), its blocks uncompiled, then compiled; rank 0 saves
    the losses, a gathered gradient and how many graphs torch made."""
    import torch.distributed as td

    from lorakit.train.prepare import compile_sharded, fully_shard

    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        adapter = load_adapter("flux", folder, dtype=torch.float32)
        batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                       torch.Generator().manual_seed(0))
        got = {}
        for compiled in (False, True):
            tr = load_component(folder / "transformer", "cpu", torch.float32).train().requires_grad_(True)
            fully_shard(tr, "cpu", keep=1 if compiled else 0)  # compiled: the last block also stays gathered
            blocks = compile_sharded(tr, {"backend": "aot_eager"}) if compiled else 0
            kept = [b._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None for b in repeated_blocks(tr)]
            torch._dynamo.utils.counters.clear()
            for _ in range(2):  # the second pass: each block's graph found again
                v = adapter.predict(tr, batch.latents.clone(), torch.tensor([0.6]), batch.text)
                v.square().mean().backward()
            got[compiled] = {"loss": v.square().mean().detach(), "blocks": blocks,
                             "grad": tr.single_transformer_blocks[1].proj_out.weight.grad.full_tensor(),
                             "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "kept": kept}
        if rank == 0:
            torch.save(got, out)
        td.barrier()  # both ranks done talking before either leaves: gloo aborts a rank whose peer left mid-way
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_under_fsdp_each_block_compiles_once_per_kind_and_trains_as_uncompiled(tiny, tmp_path):
    """FSDP2 renames a block's class (FSDP<class>); the blocks are still found, compiled around FSDP's hooks, and
    a block kind's graph serves all its blocks (tiny FLUX: one double block, two single ones -> two graphs); the
    last block kept gathered from forward to backward trains the same."""
    import torch.multiprocessing as mp

    out = tmp_path / "got.pt"
    mp.spawn(_sharded_steps, args=(2, tmp_path / "store", tiny("flux"), out), nprocs=2)
    got = torch.load(out, weights_only=True)
    assert got[True]["blocks"] == 3
    assert got[True]["kept"] == [False, False, True] and got[False]["kept"] == [False] * 3  # memory.gathered_blocks
    assert got[True]["graphs"] == 2 and got[False]["graphs"] == 0
    torch.testing.assert_close(got[True]["loss"], got[False]["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True]["grad"], got[False]["grad"], rtol=1e-4, atol=1e-6)
