"""Sharded checkpoints of a full fine-tune, with torch.distributed.checkpoint (DCP).

    <out>/checkpoints/step-NNNNNN/dcp/        every rank's shards of the weights and the optimizer state, and DCP's
                                              .metadata (written when all ranks have written)
    <out>/checkpoints/step-NNNNNN/config.json the transformer's diffusers config (for the export)
    <out>/checkpoints/step-NNNNNN/state.pt    step, scheduler, RNG, world, global batch — written last: a checkpoint
                                              without it is incomplete and never resumed from

Each rank writes its own part in parallel (no gathering on rank 0: its memory and disk stop being the limit); a run
on another number of processes reads the same files resharded to its own layout. With `output.async_save` a step's
checkpoint is copied to host memory at the step and written by a background thread (over a gloo group of its own,
apart from the training collectives) while training goes on; it counts — state.pt written, older ones pruned — once
this rank's write has finished (rank 0's finishes last: it writes .metadata after every rank's shards). The model
is exported in diffusers layout from the final checkpoint (`lorakit.convert.checkpoint`; `lorakit convert
checkpoint` does it for any step's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorakit.convert.checkpoint import DIR, first_line
from lorakit.errors import FileFormatError

WRITER_THREADS = 8  # files each rank writes at once (torch's default is 1; see docs/benchmarks.md)


@dataclass
class Pending:
    """An asynchronous save under way: its future, and what completes it."""

    future: object
    ck: Path
    state: dict | None  # state.pt's contents (rank 0), written once the shards are
    name: str


def _group(tr):
    """The gloo group the checkpoint's collectives use (made once, by every rank together)."""
    import torch.distributed as td

    if tr.dist.world == 1 or not td.is_initialized():
        return None
    if getattr(tr, "_ck_group", None) is None:
        tr._ck_group = td.new_group(backend="gloo")
    return tr._ck_group


def state_dict(tr) -> dict:
    """This rank's part of the weights and (unless 8-bit moments, which are saved per rank) the optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd = {"model": get_model_state_dict(tr.transformer)}
    if not tr.per_rank_state:
        sd["optim"] = get_optimizer_state_dict(tr.transformer, tr.opt)
    return sd


def save(tr, ck: Path, asynchronous: bool):
    """Write this rank's shards into `ck`/dcp (every rank calls it). Returns the future of an asynchronous save,
    None when the shards are written."""
    import torch.distributed.checkpoint as dcp

    group, single = _group(tr), tr.dist.world == 1
    sd = state_dict(tr)
    writer = dcp.FileSystemWriter(str(ck / DIR), thread_count=WRITER_THREADS)
    if asynchronous:
        return dcp.async_save(sd, storage_writer=writer, process_group=group, no_dist=single)
    dcp.save(sd, storage_writer=writer, process_group=group, no_dist=single)
    return None


def load(tr, ck: Path) -> None:
    """Fill the model (and optimizer) from `ck`/dcp, resharded to this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = state_dict(tr)
    try:
        dcp.load(sd, checkpoint_id=str(ck / DIR), process_group=_group(tr), no_dist=tr.dist.world == 1)
    except Exception as e:  # DCP reports missing keys and damaged files as its CheckpointException
        raise FileFormatError(f"{ck / DIR}: the sharded checkpoint does not read back ({first_line(e)})",
                              "resume from an earlier checkpoint, or start again") from None
    set_model_state_dict(tr.transformer, sd["model"])
    if "optim" in sd:
        set_optimizer_state_dict(tr.transformer, tr.opt, sd["optim"])
