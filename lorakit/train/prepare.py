"""Turning a loaded transformer into the thing a run trains: the frozen base in the profile's storage (8-bit,
4-bit, or swapped to the host block by block), LoRA (or every weight), gradient checkpointing, FSDP shards,
compiled repeated blocks. Option conflicts are refused earlier, by config validation (`config.Config`); what this
machine can do (compile, CUDA graphs, how many blocks recompute) was decided when the config was resolved
(`lorakit.plan`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lorakit.hardware import cudnn_op
from lorakit.io.modules import load_component
from lorakit.models.base import trained_dir
from lorakit.train.compile_bg import BackgroundCompile, thread_own_fx_patches
from lorakit.train.dims import Marked
from lorakit.train.lora import add_lora, keep_input_dtype
from lorakit.train.swap import BlockSwapper, repeated_blocks, swapped_names


@dataclass
class Prepared:
    transformer: object
    params: list  # what the optimizer steps
    peft_config: dict | None  # the LoRA's peft config (None: method=full)
    quantized: int  # Linear layers stored in 8 or 4 bits
    swapper: object | None  # train.swap.BlockSwapper when blocks are swapped
    sharded: bool  # FSDP
    compiled: bool  # the repeated blocks are compiled (memory.compile, as resolved)
    graphs: bool = False  # the compiled blocks replay as CUDA graphs (memory.cuda_graphs, as resolved)
    background: object | None = None  # train.compile_bg.BackgroundCompile: the blocks compile while steps run
    took: dict = field(default_factory=dict)  # seconds of each part of the preparation (the prepare phase's facts)


class Clock:
    """Seconds of each part of a phase, in order: `lap(name)` ends the part running since the last lap."""

    def __init__(self):
        self.took: dict = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.took[name] = round(now - self._t, 1)
        self._t = now


def load_base(cfg, device: str, dtype):
    """The model's transformer, read through lorakit.io. An 8-bit or 4-bit base is loaded to the CPU (mapped, no
    copy) and reaches the GPU layer by layer in its storage; with block swapping, the swapped blocks' weights
    never visit the GPU outside their turn."""

    on_gpu = device != "cpu"
    to_cpu = on_gpu and (cfg.memory.base_quant != "none" or cfg.memory.blocks_to_swap > 0)
    return load_component(trained_dir(cfg), "cpu" if to_cpu else device, dtype,
                          cfg.memory.loader, unified_memory=cfg.memory.unified_memory)


def prepare(cfg, adapter, transformer, device: str, dtype, dist) -> Prepared:
    """Put the base in its storage, add what trains, and wrap it for this machine (in that order)."""
    import torch

    full = cfg.method == "full"
    quantized = 0
    clock = Clock()
    staging: dict = {}  # the 8-bit base's wait for host memory (the mapped file's pages, the pinned copies)
    sharded = full and dist.enabled
    swapping = cfg.memory.blocks_to_swap and not sharded
    away = swapped_names(transformer, cfg.memory.blocks_to_swap) if swapping else ()  # rounded, then sent home
    if cfg.memory.compute == "fp8":  # 8-bit matmuls (this GPU runs them: plan.decide); over a bf16 base the
        from lorakit.train.quant import quantize_blocks  # weight is kept transposed as well

        quantized = quantize_blocks(transformer, dtype, device, compute="fp8",
                                    transposed=cfg.memory.base_quant == "none", stats=staging, host=away)
    elif cfg.memory.base_quant in ("fp8", "qfloat8"):
        from lorakit.train.quant import quantize_blocks

        quantized = quantize_blocks(transformer, dtype, device, stats=staging, host=away)
    elif cfg.memory.base_quant == "nf4":
        from lorakit.train.quant import quantize_blocks_nf4

        quantized = quantize_blocks_nf4(transformer, dtype, device)
    if quantized:
        clock.lap(f"{'4' if cfg.memory.base_quant == 'nf4' else '8'}-bit base")
        if "waited_s" in staging:
            clock.took["of it waiting for host memory"] = round(staging["waited_s"], 1)
    swapper = None
    if swapping:
        swapper = BlockSwapper(transformer, cfg.memory.blocks_to_swap, device, pin=cfg.memory.pin_memory)
        swapper.place_rest(transformer)
    elif not sharded:
        transformer.to(device)  # what was not quantized (loaded to the CPU for an 8-bit base)
    clock.lap("the rest placed" if not swapper else "swapped blocks placed")
    if full:
        peft_config = None
        transformer.requires_grad_(True)
    else:
        peft_config = add_lora(transformer, adapter, cfg, device=None if swapper else device)
        clock.lap("LoRA")
    compiled, graphs = cfg.memory.compile, cfg.memory.compile and cfg.memory.cuda_graphs  # resolved (lorakit.plan)
    cpp = compiled and cfg.memory.cpp_wrapper is True and not graphs  # resolved (lorakit.plan): true or false
    options = {"dynamic": compile_dynamic(cfg.memory.compile_shapes)} | ({"mode": "reduce-overhead"} if graphs else
                                                                          {"options": cpp_wrapper_options()} if cpp
                                                                          else {})
    cudnn_op.use(cpp)  # cuDNN attention as calls the C++ wrapper can make inside a compiled recompute
    # resolved (auto: as lorakit.plan decided): off with swap, FSDP, the background compile
    in_graph = compiled and cfg.memory.compiled_recompute is True
    if in_graph and (swapper or sharded):  # the compiled call skips the block's hooks: swap's copies, FSDP's gathers
        raise ValueError("memory.compiled_recompute with swapped or sharded blocks: the config was not resolved")
    recomputed = 0
    if cfg.memory.gradient_checkpointing or swapper:  # swapping needs the recompute
        n = cfg.memory.checkpoint_blocks
        recomputed = checkpoint_blocks(transformer, None if swapper or isinstance(n, str) else n,  # unplanned: all
                                       compiled=options if in_graph else None)
    if sharded:  # FSDP: each block's weights, grads and optimizer states split over the ranks
        kept = cfg.memory.gathered_blocks
        fully_shard(transformer, device, 0 if kept == "auto" else kept)
    if graphs and recomputed and not in_graph:
        raise ValueError(f"memory.cuda_graphs with {recomputed} blocks recomputing outside their compiled code: the "
                         "config was not resolved")
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not full:
        for p in params:  # LoRA weights train in fp32 whatever the base dtype, on the GPU (peft puts
            p.data = p.data.to(device, torch.float32)  # those of swapped layers beside their host weights)
        keep_input_dtype(transformer)  # their matmuls run under autocast: no fp32 copy of each input first
    clock.lap("checkpointing, trained weights")
    background = None
    if compiled:  # regional: each repeated block once (seconds, not minutes), shapes per bucket
        adapter.before_compile(transformer)
        allow_block_graphs()
        if sharded:
            compile_sharded(transformer, options)
        elif cfg.memory.compile_background is True and thread_own_fx_patches():  # compiled by a worker while the
            background = BackgroundCompile(repeated_blocks(transformer), options, device)  # first steps run eager
        else:
            transformer.compile_repeated_blocks(**options)
        if graphs:
            transformer.register_forward_pre_hook(_new_graph_generation)
        clock.lap("compile set-up")
    return Prepared(transformer, params, peft_config, quantized, swapper, sharded, compiled, graphs, background,
                    clock.took)


BLOCK_GRAPHS = 64  # graphs torch may keep for one kind of block before it runs that block uncompiled


def allow_block_graphs(limit: int = BLOCK_GRAPHS) -> None:
    """Let torch keep more graphs per compiled block than its default 8. Every block of one kind runs the same
    code, and torch counts the graphs of a piece of code together: one per bucket shape, per grad mode (training;
    samples and validation without grad), for the first block apart (its input needs no grad), for each text length
    until torch makes that size symbolic. Past the limit torch runs the block uncompiled for the rest of the
    process, silently: Qwen-Image at 24 GiB on an H100 (2026-11-26, `tools/race.py lorakit --profile rtx4090
    --cap 24`) hit "recompile_limit (8)" within 40 steps and its steps then took 2.0-2.8 s among 0.7-1.0 s ones.
    Never lowers a limit the user set higher."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * limit)


def compile_dynamic(shapes_setting: str) -> bool | None:
    """torch.compile's `dynamic`: True compiles each block for symbolic sizes from the start; None is torch's
    default, a graph for the first shape and, at the second, one with the changed sizes symbolic — before the first
    compile `train.dims` marks the sizes that vary over the run's data, so the first graph is that one."""
    return True if shapes_setting == "dynamic" else None


def _new_graph_generation(_module, _args) -> None:
    """Each pass through the transformer is one generation of its blocks' CUDA graphs: the blocks' outputs stay
    valid for the rest of the pass (the next block reads them) and are reused by the next pass. Without this,
    torch counts every compiled block's call as a new generation, and in a pass without autograd (sampling,
    validation) a block's output was overwritten before the next block read it (measured: the run's first
    sample grid failed). The transformer's own output comes from layers outside the blocks: never overwritten."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()


def fully_shard(transformer, device: str, keep: int = 0) -> None:
    """FSDP2 over the transformer: every repeated block its own unit, then the rest. The last `keep` blocks in
    execution order keep their gathered weights from forward to backward (memory.gathered_blocks, as planned)."""
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (td.get_world_size(),))
    blocks = repeated_blocks(transformer)
    first_kept = len(blocks) - max(keep, 0)
    for i, m in enumerate(blocks):  # a kept block's weights stay gathered until its backward (no second all-gather)
        shard(m, mesh=mesh, reshard_after_forward=i < first_kept)
    shard(transformer, mesh=mesh)


def cpp_wrapper_options() -> dict:
    """Inductor's options for compiled blocks whose kernels launch from C++ (memory.cpp_wrapper). torch.compile's
    `options` reach each of its compiles, the backward's too (compiled later, when first called); but the settings
    torch adds for the C++ wrapper (the kernels' binaries kept for the C++ code to load, their tuning) it adds only
    where `cpp_wrapper` is on for the whole process as a compile starts: the backward's C++ code then finds no kernel
    (torch 2.11, 2026-12-02: "CudaKernelParamCache not populated for triton_poi_fused__to_copy_mul_0"). So they
    travel with it: torch's own list for this version."""
    from torch._inductor.compile_fx import get_cpp_wrapper_config

    return {"cpp_wrapper": True, **get_cpp_wrapper_config()}


def compile_sharded(transformer, options: dict) -> int:
    """Compile each repeated block's forward under FSDP2 (returns how many). FSDP's hooks gather a block's weights
    before its forward and free them after; compiling the forward alone keeps them outside the compiled code, which
    torch never traces (diffusers' `compile_repeated_blocks` compiles the whole call, hooks included, and looks
    the blocks up by a class name FSDP has changed). Blocks of one class share their graphs, as in a regional
    compile."""
    import torch

    blocks = repeated_blocks(transformer)
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    return len(blocks)


def _checkpointed(block, *args, **kwargs):
    """A block's forward with its recompute: what `checkpoint_blocks` compiles (memory.compiled_recompute)."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(block.forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(transformer, n: int | None, compiled: dict | None = None) -> int:
    """Gradient checkpointing on the first `n` repeated blocks in execution order (None: every block). Diffusers
    routes each block through the model's checkpointing function; this one recomputes only the chosen blocks
    and runs the others as they are. Returns how many blocks recompute.

    `compiled` (torch.compile's options; memory.compiled_recompute): each chosen block's forward and its
    checkpoint compile as one function, so the compiler puts the recompute inside the block's backward graph,
    where the recompute otherwise runs the block's compiled forward again from autograd's thread before its
    compiled backward. One function for every block (torch keeps its graphs per kind of block, as for the
    blocks' own compile), its calls prepared as the blocks' own compiled calls are (`train.dims.Marked`: the data's
    varying sizes symbolic, carried inputs with gradients, joined streams); the blocks' own compiled forward still
    serves the passes without gradients."""
    import torch

    blocks = repeated_blocks(transformer)
    chosen = {id(b) for b in (blocks if n is None else blocks[:n])}
    together = torch.compile(_checkpointed, **compiled) if compiled is not None else None

    def func(block, *args):
        if id(block) in chosen:
            if together is None:
                return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
            impl = block._compiled_call_impl
            args, kwargs = impl.prepared(args, {}) if isinstance(impl, Marked) else (args, {})
            return together(block, *args, **kwargs)
        return block(*args)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=func)
    return len(chosen)
