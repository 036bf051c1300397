"""What a run does on this machine beyond the memory plan, decided once while its config is resolved (so
`--dry-run` shows it and the run follows it): whether the repeated blocks compile, whether they replay as CUDA
graphs, which attention backend is in force. Each decision that cannot give what the config asks for says why
(a run warning), instead of dropping the setting silently."""

from __future__ import annotations

from lorakit.errors import NotAvailableError
from lorakit.hardware import fa4
from lorakit.hardware.attention import cached_family_report, self_test_family
from lorakit.hardware.attention_choice import choose
from lorakit.models.base import family_adapter
from lorakit.plan.memory import PLAN_MARGIN_GIB


def compile_decision(cfg, device: str, swapper, has_blocks: bool) -> tuple[bool, str | None]:
    """Whether the repeated blocks compile, and, where memory.compile asks for it and they cannot, why (the run's
    warning). The CPU never compiles and says nothing. Under FSDP the blocks compile too (each block's forward;
    FSDP's gathers run around it: `train.prepare.compile_sharded`)."""
    if not cfg.memory.compile or not device.startswith("cuda"):
        return False, None
    why = ("with block swapping (memory.blocks_to_swap: the swapped blocks change device every step)" if swapper
           else "this transformer has no repeated blocks to compile" if not has_blocks else None)
    return why is None, why and f"memory.compile: the blocks are not compiled {why}"


def compute_decision(cfg, device: str) -> tuple[str, str | None]:
    """memory.compute as the run follows it (bf16 or fp8), and, where `auto` settles on bf16 on a GPU that has
    fp8 units, why. `auto` (the 24/32 GB profiles) multiplies in fp8 where the base is stored in 8 bits — its
    weights are e4m3 already, so the fp8 product adds only the per-token rounding of each block Linear's input
    (FLUX.1-dev rtx4090 under 24 GiB, H100: 0.582 -> 0.508 s/step, same peak memory; docs/benchmarks.md) — in a
    LoRA run, on a GPU whose PyTorch runs the fp8 products (`hardware.fp8`); bf16 otherwise.

    Raises:
        NotAvailableError: an explicit fp8 this GPU (or this PyTorch) cannot run, before any weight loads."""
    m = cfg.memory
    if m.compute == "bf16" or (m.compute == "auto" and (cfg.method == "full" or
                                                         m.base_quant not in ("fp8", "qfloat8"))):
        return "bf16", None
    from lorakit.hardware.fp8 import fp8_compute_problem  # torch: imported where a run asks for fp8

    why = fp8_compute_problem(device)  # the CPU: None (its products are the reference)
    if m.compute == "fp8":
        if why:
            raise NotAvailableError(why, "--set memory.compute=bf16")
        return "fp8", None
    if not device.startswith("cuda"):
        return "bf16", None
    return ("bf16", f"memory.compute auto: bf16 products, {why}") if why else ("fp8", None)


def graphs_decision(cfg, device: str, compiled: bool, recomputed: int, sharded: bool = False,
                    in_graph: bool = False) -> tuple[bool, str | None]:
    """Whether the compiled blocks replay as CUDA graphs (torch.compile's reduce-overhead mode: one launch per
    block instead of one per kernel, which is what a host-bound step needs), and, where memory.cuda_graphs asks for
    it and they cannot, why. `in_graph`: the recomputed blocks' recompute runs inside their compiled backward
    (memory.compiled_recompute), so the graphs hold it; a recompute outside the compiled code (a block's forward
    run again from autograd's thread, inside the backward pass) cannot be replayed. Not under FSDP, nor with
    gradient accumulation (each micro-step's pass is a new generation of the graphs, and the gradients summed over
    micro-steps may be outputs of the last one: not measured on a GPU)."""
    if not cfg.memory.cuda_graphs:
        return False, None
    if not compiled:  # nothing to capture: compile_decision said why (the CPU never compiles: no news)
        return False, (None if cfg.memory.compile or not device.startswith("cuda") else
                       "memory.cuda_graphs replays the compiled blocks: it needs memory.compile: true")
    if sharded:  # a graph replays its inputs' addresses; FSDP gathers each block's weights into new memory
        return False, "memory.cuda_graphs: the compiled blocks run without CUDA graphs under FSDP (method: full on " \
                      "several GPUs: each block's weights are gathered anew every pass)"
    if recomputed and not in_graph:
        return False, (f"memory.cuda_graphs: the compiled blocks run without CUDA graphs while {recomputed} "
                       "of them recompute outside their compiled code (memory.compiled_recompute puts the "
                       "recompute inside it)")
    if cfg.schedule.grad_accum > 1:  # one micro-step's LoRA gradients may sit in memory the next pass reuses
        return False, ("memory.cuda_graphs: the compiled blocks run without CUDA graphs with "
                       f"schedule.grad_accum={cfg.schedule.grad_accum} (measured only with 1)")
    return True, None


def compiled_recompute_decision(cfg, device: str, compiled: bool, recomputed: int, background: bool,
                                sharded: bool = False, cpp_attention: str | None = None) -> tuple[bool, str | None]:
    """Whether each recomputed block runs as one compiled function with its checkpoint (the recompute inside the
    block's compiled backward graph: one backward per block from autograd's thread, not the compiled forward again
    and then the backward), and, where memory.compiled_recompute is true (not auto) and it cannot apply, why.
    `cpp_attention`: the run's attention backend where the kernels launch from C++ (memory.cpp_wrapper): a
    recompute compiled there must not replay random state, which only lorakit's cuDNN operators avoid
    (`hardware.cudnn_op`), so with any other backend, or one measured as the run starts, it runs outside; said
    whenever it would otherwise have applied (the C++ wrapper was asked for)."""
    m = cfg.memory
    if m.compiled_recompute is False:
        return False, None
    asked = m.compiled_recompute is True
    if not compiled:  # compile_decision said why (the CPU never compiles: no news)
        return False, (None if m.compile or not asked or not device.startswith("cuda") else
                       "memory.compiled_recompute compiles the recompute with the blocks: it needs memory.compile: true")
    why = ("swapped blocks recompute around their weights' copies (memory.blocks_to_swap)" if m.blocks_to_swap
           else "under FSDP (method: full on several GPUs)" if sharded
           else "with the background compile (memory.compile_background), whose worker compiles the blocks' own "
                "calls" if background
           else "no block recomputes (the memory plan keeps every block's activations)" if not recomputed
           else None)
    if why:
        return False, (f"memory.compiled_recompute: the recompute runs outside the compiled code: {why}" if asked
                       else None)
    if cpp_attention is not None and cpp_attention != "cudnn":
        what = ("attention measured as the run starts" if cpp_attention == "auto" else f"attention {cpp_attention}")
        return False, (f"memory.compiled_recompute: the recompute runs outside the compiled code: with "
                       f"memory.cpp_wrapper it must not replay random state, and {what} is PyTorch's (only cuDNN "
                       "attention runs as lorakit's own operators: --set memory.attention=cudnn)")
    return True, None


def cpp_wrapper_decision(cfg, device: str, compiled: bool, graphs: bool, background: bool,
                         compiler: str | None = "") -> tuple[bool, str | None]:
    """Whether the compiled blocks launch their kernels from C++ (memory.cpp_wrapper), and, where it was asked for
    (true) and cannot apply, why. Not with CUDA graphs (a replay is one launch already), nor under "auto" with the
    background compile (not measured); it needs a C++ compiler (`compiler`: the one found, "" to look for it)."""
    asked = cfg.memory.cpp_wrapper
    if asked is False or not compiled or not device.startswith("cuda"):
        return False, ("memory.cpp_wrapper launches the compiled blocks' kernels: it needs memory.compile: true"
                       if asked is True and device.startswith("cuda") and not compiled else None)
    if graphs:
        return False, ("memory.cpp_wrapper: the compiled blocks replay as CUDA graphs (memory.cuda_graphs), one "
                       "launch each already" if asked is True else None)
    if background and asked == "auto":
        return False, None
    compiler = cxx() if compiler == "" else compiler
    if compiler is None:
        return False, ("memory.cpp_wrapper needs a C++ compiler to build the blocks' launch code: install g++ (or "
                       "set CXX)" if asked is True else None)
    return True, None


def cxx() -> str | None:
    """The C++ compiler Inductor's C++ wrapper would call ($CXX, else g++), where it is on the PATH."""
    import os
    import shutil

    return shutil.which(os.environ.get("CXX") or "g++")


def background_decision(cfg, compiled: bool, graphs: bool, est: dict | None, budget_gib: float | None,
                        sharded: bool = False) -> tuple[bool, str | None]:
    """memory.compile_background as the run follows it (true or false), and, where it asked for true and cannot,
    why. Until the worker is done the blocks run uncompiled, which holds more activations than compiled blocks
    (FLUX.1 1024² on an H100: 47.3 GiB against 42.0), and the worker runs one block forward and backward beside the
    run; so "auto" turns it on only where the plan saved no memory (the card has room to spare) and the estimate
    plus one block's working set leaves the plan's margin free."""
    asked = cfg.memory.compile_background
    if asked is False or not compiled:
        return False, None
    why = ("with CUDA graphs (memory.cuda_graphs)" if graphs
           else "under FSDP (a worker's block calls would gather weights out of step with the other ranks)"
           if sharded else "with LoRA dropout (the worker would draw from the run's random numbers)"
           if cfg.method == "lora" and cfg.lora.dropout else None)
    if why is None and asked == "auto":
        why = lacks_room(cfg, est, budget_gib, uncompiled=True)
    if why:
        return False, (f"memory.compile_background: the blocks compile while step 1 waits, {why}"
                       if asked is True else None)
    return True, None


def lacks_room(cfg, est: dict | None, budget_gib: float | None, uncompiled: bool = False) -> str | None:
    """Why the card has no room to spare beside the run (None: it has): the memory plan saved memory (an 8-bit
    base, recomputed or swapped blocks), or the estimate plus one block's working set (and, `uncompiled`, what
    uncompiled blocks hold beyond compiled ones) leaves less than the plan's margin. What runs beside the run (the
    background compile, the first run's attention self-test) needs room."""
    m = cfg.memory
    if m.base_quant != "none" or m.gradient_checkpointing or m.blocks_to_swap:
        return "where the memory plan saves memory (an 8-bit base, recomputed or swapped blocks)"
    if est is not None and budget_gib:
        need = est.get("uncompiled_gib", est["gib"]) if uncompiled else est["gib"]
        need += est.get("block_gib", 0.0)
        if need > budget_gib - PLAN_MARGIN_GIB:
            return f"for lack of GPU memory (about {need:.1f} GiB with the worker's pass, of {budget_gib:.0f})"
    return None


def attention_can_wait(cfg, device: str, world: int, room: bool) -> bool:
    """Can this run measure its attention backends while it starts (beside its caching and model load) instead of
    before anything (the first run of the family on this machine)? Where memory.attention is auto, nothing is
    cached yet, the card has room for the measuring child processes beside the loading, and the run is one process
    (ranks must agree)."""
    return (device.startswith("cuda") and cfg.memory.attention == "auto" and room and world == 1
            and cached_family_report(cfg.model.family, device) is None)


def choice_from(report, cfg, device: str, note=None) -> str:
    """The backend a run puts in force from a self-test report (see `attention_backend`)."""
    choice = choose(report, cfg.model.family, resolution=cfg.data.resolution)  # fastest at this run's size
    why = fa4.problem(device) if choice and "fa4" in choice.split("+") else None
    if why:
        was, choice = choice, choose(report, cfg.model.family, resolution=cfg.data.resolution, exclude={"fa4"})
        if note:
            note(f"attention: this machine's measurements chose {was} for {cfg.model.family}, but {why}; "
                 f"this run uses {choice or 'PyTorch defaults'} (`lorakit doctor --retest` measures again)")
    return choice or "auto"


def repeated_block_kinds(family: str) -> list[str]:
    """The kinds of repeated block the family's diffusers transformer class declares (what regional compile
    compiles, one graph each), in its order."""
    import diffusers

    cls = getattr(diffusers, family_adapter(family).info.transformer_class)
    return list(getattr(cls, "_repeated_blocks", None) or ())


def has_repeated_blocks(family: str) -> bool:
    """Does the family's diffusers transformer class declare repeated blocks?"""
    return bool(repeated_block_kinds(family))


def attention_backend(cfg, device: str, note=None, measured=None) -> str:
    """The SDPA backend a training run puts in force: memory.attention as given, else this machine's self-test
    choice for the family at the run's resolution (measured once per machine and cached). "auto" on the CPU, or
    where no backend passed (PyTorch then picks per call).

    A cached choice of FlashAttention 4 that cannot run now (the package broken or gone since it was measured)
    gives way to the next fastest measured backend, said through `note`; an explicit memory.attention with fa4
    that cannot run here is refused.

    `measured`: called with the seconds a measurement took where it ran now (the first run here), not where a
    cached one answered.

    Raises:
        NotAvailableError: memory.attention names fa4 and it cannot run here.
    """
    if not device.startswith("cuda"):
        return cfg.memory.attention
    if cfg.memory.attention != "auto":
        why = fa4.problem(device) if "fa4" in cfg.memory.attention.split("+") else None
        if why:
            raise NotAvailableError(why, "--set memory.attention=auto")
        return cfg.memory.attention
    report = self_test_family(cfg.model.family, device)  # measured once per machine
    if measured and not report.cached and report.seconds is not None:
        measured(report.seconds)
    return choice_from(report, cfg, device, note)


def has_fp8_units(device: str) -> bool:
    """Does this GPU have fp8 matrix units (compute capability 8.9+)? Whether its PyTorch runs the products is
    tried where a run asks for them (`hardware.fp8`)."""
    import torch

    return device.startswith("cuda") and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(torch.device(device)) >= (8, 9)


def step_line(cfg, device: str, asked_attention: str, graphs_possible: bool, fp8_possible: bool,
              deferred: bool = False, recompute_possible: bool = False) -> str:
    """What the training step runs with, in one line (the run says it as it starts, `--dry-run` too): compiled
    blocks or not, the attention backend and where it came from, bf16 or fp8 products, CUDA graphs or not — and,
    for the last two and the compiled recompute where the run left them off and this machine could take them (as
    decided for the run with them asked for), the setting that turns them on (on the datacenter profile neither fp8
    nor CUDA graphs is the default: docs/benchmarks.md, "One training step"). Each decision that could not give what
    the config asked says why in its own note."""
    m = cfg.memory
    if not device.startswith("cuda"):
        return "uncompiled blocks, PyTorch's attention, products in the model's dtype (the CPU)"
    parts = [("compiled blocks" + (", compiling beside the first steps" if m.compile_background else ""))
             if m.compile else "uncompiled blocks"]
    if m.compiled_recompute is True:
        parts[0] += ", their recompute compiled into the backward"
    elif recompute_possible:
        parts[0] += " (recompute compiled with them: --set memory.compiled_recompute=true)"
    if m.cpp_wrapper is True:
        parts[0] += ", their kernels launched from C++"
    if deferred and m.attention == "auto":  # not yet measured
        parts.append("attention: this machine's fastest, measured as the run starts")
    elif m.attention == "auto":
        parts.append("attention as PyTorch picks it per call")
    else:
        how = "this machine's fastest" if asked_attention == "auto" else "as set"
        parts.append(f"attention {m.attention} ({how})")
    parts.append("fp8 products" if m.compute == "fp8" else
                 "bf16 products" + (" (fp8: --set memory.compute=fp8)" if fp8_possible else ""))
    on = "--set memory.cuda_graphs=true" + (": compiled at step 1, not beside it" if m.compile_background else
                                            ": each bucket shape and text length records its graphs once, a slow step"
                                            if m.compiled_recompute is True else "")
    parts.append("CUDA graphs" if m.cuda_graphs else "no CUDA graphs" + (f" ({on})" if graphs_possible else ""))
    return "; ".join(parts)
