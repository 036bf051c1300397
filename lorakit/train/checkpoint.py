"""Checkpoints of a run: save, resume (on any number of GPUs), find the newest, export the final result.

    <out>/checkpoints/step-NNNNNN/   lora.safetensors + state.pt; method=full: dcp/ (every rank's shards, see
                                     shards.py) + config.json + state.pt, or with output.checkpoint_format=gathered
                                     transformer/ (the whole model, diffusers layout, written by rank 0) + state.pt
    <out>/checkpoints/final/         the same, after the last step (a full fine-tune's, where that step has its
                                     step checkpoint: hard links to its files, the state not written twice)
    <out>/<name>.safetensors         the final LoRA (or <name>-transformer/, exported from final/)

Every file is written atomically (temporary sibling, then rename), so a kill at any moment leaves the
previous checkpoint whole. state.pt holds the step, optimizer, LR scheduler and RNG state, the number of
processes and the global batch it was written with.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from lorakit.convert.checkpoint import DIR as SHARDS
from lorakit.convert.checkpoint import export_checkpoint
from lorakit.convert.checkpoint import intact as shards_intact
from lorakit.errors import FileFormatError, InputError, LorakitError, environment_fault
from lorakit.io import atomic_path, link_or_copy, load, read_header, resolve_files, save_sharded
from lorakit.io.pt import NotPlainData, load_pt
from lorakit.train import shards
from lorakit.train.lora import load_lora_into, lora_state_dict, save_lora
from lorakit.train.prepare import Clock
from lorakit.train.resume import check_lora_shapes, check_schedule, schedule_facts


def save(tr, final: bool = False, name: str | None = None, background: bool = False) -> tuple[Path, dict | None]:
    """Write a checkpoint of the trainer (rank 0 writes; every rank takes part in gathering FSDP shards, or writes
    its own with sharded checkpoints). `name`: a checkpoint other than step-N / final (best); `background`: a
    sharded step checkpoint may be written while training goes on (output.async_save). Returns the checkpoint
    folder and the saved LoRA read back as each consumer reads it (None for method=full)."""
    import torch

    consumer_check, clock = None, Clock()
    tr.save_took = clock.took  # the parts of this save, in seconds (the checkpoint phase's facts)
    if tr.full and name is None and tr.step_saved is not None and tr.step_saved[0] == tr.step:
        return _saved_already(tr, tr.step_saved[1], final, clock), None
    name = name or ("final" if final else f"step-{tr.step:06d}")
    ck = tr.out / "checkpoints" / name
    if not final and name.startswith("step-"):
        tr.step_saved = (tr.step, ck)  # what the run's end reuses where no step follows (a full fine-tune)
    if torch.device(tr.device).type == "cuda":  # the steps' queued GPU work ends first, timed apart from the save
        torch.cuda.synchronize(tr.device)
        clock.lap("the last steps' GPU work")
    if tr.full and tr.cfg.output.checkpoint_format == "sharded":
        return _save_sharded(tr, ck, name, background and tr.cfg.output.async_save), None
    if tr.full:
        weights, opt_state = _full_state(tr)
        if opt_state is None:  # per-rank 8-bit optimizer state
            ck.mkdir(parents=True, exist_ok=True)
            with atomic_path(rank_state_file(tr, ck)) as tmp:
                torch.save(tr.opt.state_dict(), tmp)
    if tr.dist.main:
        ck.mkdir(parents=True, exist_ok=True)
        if tr.full:
            _save_transformer(tr.transformer, weights, ck / "transformer")
            clock.lap("transformer written")
        else:
            with tr.averaged():  # the LoRA file holds the EMA weights when EMA is on
                consumer_check = save_lora(tr.transformer, ck / "lora.safetensors", tr.cfg.model.family,
                                           {"lorakit_step": tr.step, **({"lorakit_ema_decay": tr.ema.decay}
                                                                        if tr.ema else {}),
                                            **({"lorakit_expert": e} if (e := tr.adapter.expert(tr.cfg.model.expert))
                                               else {})}, clock=clock)
            opt_state = tr.opt.state_dict()
        state = _state(tr, optimizer=opt_state)
        if not tr.full:  # the trainable tensors bit for bit (the file has alpha folded into B)
            state["lora"] = {k: v.cpu() for k, v in lora_state_dict(tr.transformer).items()}
        clock.lap("training state gathered")
        with atomic_path(ck / "state.pt") as tmp:
            torch.save(state, tmp)
        clock.lap("state.pt written")
        if not final and name.startswith("step-"):
            _prune(tr)
    tr.dist.barrier()
    return ck, consumer_check


def _saved_already(tr, ck: Path, final: bool, clock) -> Path:
    """A full fine-tune's end at a step whose step checkpoint `ck` was just saved (output.save_every divides the
    steps, or a stop right after a save): that save completes and is the run's checkpoint — `final` is made of hard
    links to its files (`io.link_or_copy`), not a second write of the same state (FLUX.2 [klein] 4B's 22 GB took
    18.7 s more on 2x H100, 2026-11-28; FLUX.1-dev's is 71 GB). A LoRA run writes its
    few MB again: two files, each whole on its own."""
    wait(tr)
    clock.lap(f"{ck.name}'s save completed")
    if not final:
        return ck
    dst = ck.parent / "final"
    if tr.dist.main:
        try:
            (dst / "state.pt").unlink(missing_ok=True)  # whole only when its state.pt is back (as a rewrite)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(ck, dst, copy_function=link_or_copy,
                            ignore=lambda d, names: ["state.pt"] if d == str(ck) else [])
            link_or_copy(ck / "state.pt", dst / "state.pt")
        except OSError as e:
            raise environment_fault(e, dst) or e from None
        clock.lap(f"final/ linked to {ck.name}'s files")
    tr.dist.barrier()
    return dst


def _prune(tr) -> None:
    kept = sorted(p for p in (tr.out / "checkpoints").glob("step-*") if p.is_dir())
    for old in kept[: -tr.cfg.output.keep_last]:
        shutil.rmtree(old)


def _state(tr, **extra) -> dict:
    """What state.pt holds besides the weights (and the optimizer's moments, where it holds them)."""
    return {**tr.state.state_dict(extra.pop("optimizer", None)), "world": tr.dist.world,
            "global_batch": tr.global_batch, "schedule": schedule_facts(tr.cfg), **extra}


def _save_sharded(tr, ck: Path, name: str, background: bool) -> Path:
    """Every rank writes its shards (see shards.py); state.pt follows when they are all written."""
    import copy

    import torch

    wait(tr)  # the previous background save completes first
    if tr.dist.main:
        (ck / "state.pt").unlink(missing_ok=True)  # a rewrite (best, final) is whole only when its state.pt is back
        shutil.rmtree(ck / SHARDS, ignore_errors=True)
        ck.mkdir(parents=True, exist_ok=True)
        with atomic_path(ck / "config.json") as tmp:
            tmp.write_text(json.dumps(transformer_config(tr.transformer), indent=2, sort_keys=True, default=list))
    tr.dist.barrier()
    if tr.per_rank_state:  # 8-bit moments: this rank's optimizer as it is
        with atomic_path(rank_state_file(tr, ck)) as tmp:
            torch.save(tr.opt.state_dict(), tmp)
    state = copy.deepcopy(_state(tr, format="sharded")) if tr.dist.main else None
    written, staged = shards.save(tr, ck, background)
    p = shards.Pending(written, ck, state, name, staged)
    if p.future is None:
        _complete(tr, p)
        tr.dist.barrier()
    else:
        tr.pending = p
    return ck


def _complete(tr, p) -> None:
    import torch

    if p.future is not None:
        try:
            p.future.result()
        except OSError as e:
            raise environment_fault(e, p.ck / SHARDS) or e from None
    if tr.dist.main:
        with atomic_path(p.ck / "state.pt") as tmp:
            torch.save(p.state, tmp)
        if p.name.startswith("step-"):
            _prune(tr)


def poll(tr) -> None:
    """Complete a background save whose shards are written (called after every step)."""
    p = tr.pending
    if p is not None and p.future.done():
        tr.pending = None
        _complete(tr, p)


def wait(tr) -> None:
    """Complete a background save, waiting for its shards."""
    p, tr.pending = tr.pending, None
    if p is not None:
        _complete(tr, p)


def release(tr) -> None:
    """The run saves no more: a background save completes and its pinned staging buffers are freed."""
    wait(tr)
    shards.release(tr)


def resume(tr, ck: Path) -> dict:
    """Continue from a checkpoint (written by any number of ranks). Returns what changed, if anything."""
    sharded = tr.full and (ck / SHARDS).is_dir()
    weights = ck / (SHARDS if sharded else "transformer" if tr.full else "lora.safetensors")
    if not ck.is_dir():
        raise InputError(f"--resume {ck}: no such checkpoint folder")
    if not weights.exists() or not (ck / "state.pt").is_file():
        what = "dcp/ or transformer/, and state.pt" if tr.full else "lora.safetensors + state.pt"
        raise InputError(f"{ck} is not a lorakit checkpoint of this method ({what})",
                         "method=full and method=lora checkpoints do not mix")
    state = read_state(ck / "state.pt")
    wait(tr)  # a save still being written completes before the weights are replaced
    tr.step_saved = None  # the state is the checkpoint's from here: no save of this process stands for it
    if sharded:
        shards.load(tr, ck)
        if tr.per_rank_state:
            _per_rank_optimizer(tr, ck, state)
    elif tr.full:
        _resume_full(tr, ck, weights, state)
    else:
        saved = state["lora"] if "lora" in state else load(weights, copy=True)  # older: the file is raw
        check_lora_shapes(lora_state_dict(tr.transformer), saved, str(ck))
        load_lora_into(tr.transformer, saved)
        tr.opt.load_state_dict(state["optimizer"])
    notes = tr.state.load_state_dict(state, str(ck / "state.pt"), tr.params)
    changed, reschedule = check_schedule(tr.cfg, state, tr.step, str(ck))
    notes += changed
    if reschedule:  # the new peak and shape from this step (the scheduler restored the checkpoint's peak)
        tr.sched.base_lrs = [tr.cfg.optim.lr for _ in tr.sched.base_lrs]
        for g, base, f in zip(tr.opt.param_groups, tr.sched.base_lrs, tr.sched.lr_lambdas, strict=True):
            g["lr"] = base * f(tr.sched.last_epoch)
    was = state.get("global_batch", tr.global_batch)
    if was != tr.global_batch:
        notes.append(f"the checkpoint was written with a global batch of {was}, this run's is {tr.global_batch}: "
                     "the data order continues from the same batch index with the new batch size")
    return {"from_world": state.get("world", 1), "from_global_batch": was, "note": "; ".join(notes) or None}


def _resume_full(tr, ck: Path, weights: Path, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    main = tr.dist.main
    set_model_state_dict(tr.transformer, load(weights) if main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=tr.sharded))
    if tr.per_rank_state or state["optimizer"] is None:
        _per_rank_optimizer(tr, ck, state)
    else:  # weights that never get a gradient (e.g. the last block's unused text output) have no state
        set_optimizer_state_dict(tr.transformer, tr.opt, state["optimizer"] if main else {},
                                 options=StateDictOptions(full_state_dict=True, strict=False,
                                                          broadcast_from_rank0=tr.sharded))


def _per_rank_optimizer(tr, ck: Path, state: dict) -> None:
    mine = rank_state_file(tr, ck)
    if not (tr.per_rank_state and mine.is_file()):
        raise InputError(f"{ck} holds 8-bit optimizer states of {state.get('world', 1)} GPU(s) (one file per "
                         f"GPU); this run has {tr.dist.world} with {type(tr.opt).__name__}",
                         f"resume with --gpus {state.get('world', 1)} and the same optim.name, or train with "
                         "optim.name=adamw (its checkpoints resume on any GPU count)")
    tr.opt.load_state_dict(read_state_any(mine))


def snapshot(tr) -> dict:
    """The trained tensors of a LoRA run as they are now (the LoRA and its average), to put back later."""
    return {"lora": {k: v.detach().clone() for k, v in lora_state_dict(tr.transformer).items()},
            "ema": [s.detach().clone() for s in tr.ema.shadow] if tr.ema else None}


def _put(tr, snap: dict) -> None:
    load_lora_into(tr.transformer, snap["lora"])
    if tr.ema and snap.get("ema") is not None:
        for s, v in zip(tr.ema.shadow, snap["ema"], strict=True):
            s.copy_(v)


@contextlib.contextmanager
def weights_in(tr, snap: dict):
    """The trainer with other LoRA tensors (and average) in place for the duration (LoRA runs)."""
    mine = snapshot(tr)
    _put(tr, snap)
    try:
        yield
    finally:
        _put(tr, mine)


@contextlib.contextmanager
def weights_of(tr, ck: Path):
    """The trainer with another checkpoint's LoRA (and average) in place for the duration (LoRA runs)."""
    state = read_state(ck / "state.pt")
    mine = snapshot(tr)
    try:
        load_lora_into(tr.transformer, state["lora"])
        if tr.ema and "ema" in state:
            tr.ema.load_state_dict(state["ema"], str(ck / "state.pt"))  # checked against this run's LoRA
        yield
    finally:
        _put(tr, mine)


def read_state_any(path: Path):
    """A per-rank optimizer file, read like read_state (any object, not only a state dict)."""
    try:
        return load_pt(path, map_location=None)
    except NotPlainData:
        raise
    except FileFormatError as e:
        raise FileFormatError(f"{path}: damaged optimizer state ({e.message.removeprefix(f'{path}: ')})") from None


def read_state(path: Path) -> dict:
    """state.pt, read without running code (weights_only); a damaged or refused file is an error naming it."""
    if not Path(path).exists():
        raise FileFormatError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        state = load_pt(path, map_location=None)
    except NotPlainData:
        raise
    except FileFormatError as e:
        raise FileFormatError(f"{path}: damaged checkpoint state ({e.message.removeprefix(f'{path}: ')})",
                              "resume from an earlier checkpoint, or start again") from None
    if not isinstance(state, dict) or "step" not in state:
        raise FileFormatError(f"{path}: not a lorakit checkpoint state (no step)")
    return state


def check_intact(ck: Path, full: bool) -> str | None:
    """Why a checkpoint cannot be resumed from (None when it can): state.pt's archive directory reads (a cut-off
    file does not; its contents are read at resume, which names the file if they are damaged) and every
    weight file's header validates against its size."""
    import zipfile

    state = ck / "state.pt"
    try:
        if not state.is_file():
            return f"{state}: missing (the checkpoint is incomplete)"
        try:
            with zipfile.ZipFile(state) as z:
                size = state.stat().st_size
                if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                    return f"{state}: damaged checkpoint state (cut off)"
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"{state}: damaged checkpoint state ({type(e).__name__})"
        if full and (ck / SHARDS).is_dir():
            return shards_intact(ck)
        weights = ck / ("transformer" if full else "lora.safetensors")
        for f in resolve_files(weights):
            read_header(f)
    except LorakitError as e:
        return e.message
    return None


def latest(out_dir: Path, full: bool = False) -> tuple[Path | None, list[str]]:
    """The newest step checkpoint of a run folder that reads back whole (None when there is none), and a
    warning for each newer one that is damaged (a kill at the wrong moment, a full disk)."""
    final = out_dir / "checkpoints" / "final"  # a finished run's last state: newer than any step
    cks = ([final] if final.is_dir() else []) + sorted(
        (p for p in (out_dir / "checkpoints").glob("step-*") if p.is_dir()), reverse=True)
    damaged = []
    for ck in cks:
        why = check_intact(ck, full)
        if why is None:
            return ck, [f"skipped damaged checkpoint {ck}: {w}" for w in damaged]
        damaged.append(why)
    return None, [f"damaged checkpoint: {w}" for w in damaged]


def export(tr, ck: Path) -> dict:
    """The run's result beside its checkpoints: <name>.safetensors (LoRA) or <name>-transformer/ (full)."""
    out = tr.out
    if tr.full:
        final = out / f"{tr.cfg.output.name}-transformer"
        shutil.rmtree(final, ignore_errors=True)
        try:
            if (ck / SHARDS).is_dir():  # the shards read back whole, in diffusers layout
                export_checkpoint(ck, final)
            else:
                shutil.copytree(ck / "transformer", final)
        except OSError as e:
            raise environment_fault(e, final) or e from None
        return {"transformer": str(final)}
    final = out / f"{tr.cfg.output.name}.safetensors"
    with atomic_path(final) as tmp:
        shutil.copyfile(ck / "lora.safetensors", tmp)
    expert = tr.adapter.expert(tr.cfg.model.expert)
    return {"lora": str(final), **({"expert": expert} if expert else {})}


def rank_state_file(tr, ck: Path) -> Path:
    return ck / f"optimizer-rank{tr.dist.rank}-of-{tr.dist.world}.pt"


def _full_state(tr) -> tuple[dict, dict | None]:
    """Whole-model weights and optimizer state keyed by parameter name (gathered from the shards on rank 0
    under FSDP), so a checkpoint resumes on any number of GPUs. 8-bit moments: saved per rank (None)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(tr.transformer, options=opts)
    if tr.per_rank_state:
        return weights, None
    return weights, get_optimizer_state_dict(tr.transformer, tr.opt, options=opts)


def transformer_config(transformer) -> dict:
    """The transformer's diffusers config.json (its class: the diffusers class under any wrapper)."""
    cls = next(c for c in type(transformer).__mro__ if c.__module__.startswith("diffusers."))
    config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
    config["_class_name"] = cls.__name__
    try:
        import diffusers

        config["_diffusers_version"] = diffusers.__version__
    except ImportError:
        pass
    return config


def _save_transformer(transformer, weights: dict, folder: Path) -> None:
    """A fully trained transformer in diffusers layout: config.json + (sharded) safetensors."""
    save_sharded({k: v.contiguous() for k, v in weights.items()}, folder)
    with atomic_path(folder / "config.json") as tmp:
        tmp.write_text(json.dumps(transformer_config(transformer), indent=2, sort_keys=True, default=list))
