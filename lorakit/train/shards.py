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
this rank's write has finished (rank 0's finishes last: it writes .metadata after every rank's shards). The copy
goes into pinned host buffers kept from one save to the next (`stager`), on a CUDA stream of its own: the step goes
on beside it, and only the optimizer update waits for it (`staged`); once the buffers exist, synchronous saves
(best, final) are written from them too (at the disk's speed: the writer threads then read host memory). The model
is exported in diffusers layout from the final checkpoint (`lorakit.convert.checkpoint`; `lorakit convert
checkpoint` does it for any step's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from lorakit.convert.checkpoint import DIR, first_line
from lorakit.errors import FileFormatError, environment_fault
from lorakit.io.pinned import HostArena, pinnable

WRITER_THREADS = 8  # files each rank writes at once (torch's default is 1; see docs/benchmarks.md)


@dataclass
class Pending:
    """An asynchronous save under way: its futures, and what completes it."""

    future: object  # the shards written
    ck: Path
    state: dict | None  # state.pt's contents (rank 0), written once the shards are
    name: str
    staged: object = None  # the copy to host memory taken (the weights may change from then on)


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


class Stager:
    """A stager for asynchronous saves (torch.distributed.checkpoint's AsyncStager protocol): this rank's share of
    the state — each DTensor's local shard, each plain tensor — copied into pinned host buffers allocated at the
    first save and reused by the next ones (the copy runs at the link's speed, not into fresh pageable memory), a
    plain `copy_` of each local part, on a thread and a CUDA stream of their own (on the CPU: the thread only). `stage`
    returns at once with the copy's future; the state DCP then writes holds the buffers (DTensors over them where
    the state has DTensors) and this save's own non-tensor values (learning rates, steps). Close it to free the
    buffers.

    torch's StateDictStager was used before: it copies the state through DTensor's Python dispatch tensor by
    tensor, holding the interpreter the run's step needs — 0.64-0.71 s a save for 3,000 small DTensors and 1,500
    scalars on an idle 2-core CPU, where this stager takes 0.044-0.064 s after its first save (2026-11-27; with
    it, the step beside a FLUX.1-dev full fine-tune's copy on 2x H200 took 2.7-2.9 s instead of 0.64-0.77). torch's
    DefaultStager besides empties its copier after every save in torch 2.11 and fails on the second."""

    should_synchronize_after_execute = False

    def __init__(self, cuda: bool):
        import inspect
        from concurrent.futures import ThreadPoolExecutor

        import torch
        import torch.distributed.checkpoint as dcp

        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            raise ImportError("this torch's torch.distributed.checkpoint.async_save takes no stager")
        self._pin = cuda
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorakit-staging")
        self._stream = torch.cuda.Stream() if cuda else None  # on this process's device (made on the main thread)
        self._layout = None  # what the buffers were made for: each tensor's place, kind, shape, dtype
        self._held: list = []  # per tensor of the state, in walking order: what the staged state holds for it
        self._buffers: list = []  # the host tensors the copy fills (the local shards of the DTensors in `_held`)
        self.arena = None  # where the buffers live (`io.pinned.HostArena`: page-locked chunks, packed)

    def stage(self, state_dict):
        import torch

        # the copy starts after what the run's stream has queued (the update that made these values): an event on
        # the caller's stream, which the copy's stream waits for
        ready = torch.cuda.current_stream(self._stream.device).record_event() if self._stream is not None else None
        return self._thread.submit(self._stage, state_dict, ready)

    def _stage(self, state_dict, ready=None):
        import contextlib

        import torch

        if ready is not None:  # this thread's device is cuda:0 until told: the pinning and the copy use the rank's
            torch.cuda.set_device(self._stream.device)
        sources: list = []
        layout = _tensors(state_dict, sources)
        local = [part for _, part in sources]
        if layout != self._layout:  # the first save (or the state changed its make-up): buffers for it
            self._held, self._buffers = [], []
            self.arena = _arena(local, self._pin)
            for t, part in sources:
                held, buf = _host_copy(t, part, self.arena)
                self._held.append(held)
                self._buffers.append(buf)
            self._layout = layout
        if ready is not None:
            self._stream.wait_event(ready)
        with torch.no_grad(), (torch.cuda.stream(self._stream) if self._stream is not None
                               else contextlib.nullcontext()):
            for buf, part in zip(self._buffers, local, strict=True):  # plain tensors: ~10 us a copy to queue
                buf.copy_(part, non_blocking=self._stream is not None)
        if self._stream is not None:
            self._stream.synchronize()
        return _rebuilt(state_dict, iter(self._held))

    def synchronize_staging(self) -> None:
        pass  # the caller waits on the future `stage` returned

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._held, self._buffers, self._layout, self.arena = [], [], None, None


def _tensors(obj, out: list, path: str = "") -> tuple:
    """The state's tensors appended to `out` in walking order, each with its local part; returns their layout
    (place, DTensor spec, shape, dtype, device type: what decides whether the buffers made for an earlier save
    still fit)."""
    import torch

    if isinstance(obj, dict):
        return tuple(x for k, v in obj.items() for x in _tensors(v, out, f"{path}/{k}"))
    if isinstance(obj, (list, tuple)):
        return tuple(x for i, v in enumerate(obj) for x in _tensors(v, out, f"{path}/{i}"))
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        out.append((obj, local))
        spec = (tuple(obj.placements), obj.device_mesh, tuple(local.shape)) if local is not obj else None
        return ((path, spec, tuple(obj.shape), obj.dtype, obj.device.type),)
    return ()


def _rebuilt(obj, held):
    """The state with each tensor replaced by its host copy (in walking order), other values as they are now."""
    import copy

    import torch

    if isinstance(obj, dict):
        return {k: _rebuilt(v, held) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuilt(v, held) for v in obj)
    if isinstance(obj, torch.Tensor):
        return next(held)
    return copy.deepcopy(obj)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t):
    """A DTensor's local shard (read as it is: `to_local` would go through autograd for each of thousands of
    tensors), a tensor itself."""
    if not _is_dtensor(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def _arena(local: list, pin: bool):
    """The host memory for a save's buffers: page-locked chunks that pack them (`io.pinned.HostArena`) as far as the
    host has room, the rest pageable. Pinned one by one, torch's caching host allocator rounds each buffer up to a
    power of two: FLUX.1-dev's 3072x3072 and 3072x12288 matrices (9 and 36 x 2^20 elements) and their moments would
    take 1.78 times their size (16 and 64 x 2^20)."""
    size = sum(p.numel() * p.element_size() for p in local)
    room = pinnable() if pin else None
    return HostArena(pin and room > 0, expect=size, limit=room, register=True)  # locked beside the steps


def _host_copy(t, local, arena):
    """(what the staged state holds for `t`, the host buffer the copy fills): room for `t`'s local part `local` in
    `arena` (a tensor of its own where the arena has no room or `local` is a tensor subclass), and where `t` is a
    DTensor a DTensor of `t`'s spec over it."""
    import torch

    buf = arena.empty(local.shape, local.dtype, whole=True) if type(local) is torch.Tensor else None
    if buf is None:
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu")
    if not _is_dtensor(t):
        return buf, buf
    from torch.distributed.tensor import DTensor

    # `t`'s spec (mesh, placements, global shape and stride) over the host buffer, as torch's own stager keeps it:
    # DTensor.from_local would move the buffer to the mesh's device — a GPU copy of this rank's whole state, made
    # on the thread's current device (cuda:0 for every rank): out of memory on 2x H100, 2026-11-27
    return DTensor(buf, t._spec, requires_grad=False), buf


def stager(tr):
    """The run's `Stager`, made at its first asynchronous save; `release` frees it. None where this torch's DCP takes
    no stager (older releases): DCP then copies the state itself at the call, as lorakit did before."""
    import torch

    if getattr(tr, "_stager", None) is None:
        try:
            tr._stager = Stager(torch.device(tr.device).type == "cuda")
        except ImportError:
            return None
    return tr._stager


def refused_note(tr) -> str | None:
    """What the run says where page-locking its background checkpoints' buffers was refused (known once a background
    save has made them), else None."""
    arena = getattr(getattr(tr, "_stager", None), "arena", None)
    if arena is None or not arena.refused:
        return None
    return (f"background checkpoints: page-locking their host buffers was refused (CUDA error {arena.refused}); they "
            "copy into pageable memory, which holds each save's step longer")


def release(tr) -> None:
    """Free the run's pinned staging buffers (after its last save)."""
    st, tr._stager = getattr(tr, "_stager", None), None
    if st is not None:
        st.close()


def save(tr, ck: Path, asynchronous: bool) -> tuple[object, object]:
    """Write this rank's shards into `ck`/dcp (every rank calls it). Returns the futures of an asynchronous save
    (the shards written, the copy taken), (None, None) when the shards are written."""
    import torch.distributed.checkpoint as dcp

    group, single = _group(tr), tr.dist.world == 1
    sd = state_dict(tr)
    writer = dcp.FileSystemWriter(str(ck / DIR), thread_count=WRITER_THREADS)
    st = stager(tr) if asynchronous or getattr(tr, "_stager", None) is not None else None
    if st is not None:  # through the pinned buffers: at the disk's speed
        r = dcp.async_save(sd, storage_writer=writer, async_stager=st, process_group=group, no_dist=single)
        written, staged = getattr(r, "upload_completion", r), getattr(r, "staging_completion", None)
        if asynchronous:
            return written, staged
        written.result()
        return None, None
    if asynchronous:  # a torch whose DCP takes no stager: the copy is taken inside the call
        return dcp.async_save(sd, storage_writer=writer, process_group=group, no_dist=single), None
    dcp.save(sd, storage_writer=writer, process_group=group, no_dist=single)
    return None, None


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


def staged(tr) -> None:
    """Wait until a background save's copy of the weights and optimizer state is taken (what changes them — the
    optimizer update — calls this first); the time waited adds to `tr.staging_wait_s`."""
    p = tr.pending
    if p is not None and p.staged is not None:
        t = time.perf_counter()
        try:
            p.staged.result()
        except OSError as e:  # the pinned buffers could not be had (host memory)
            raise environment_fault(e, p.ck / DIR) or e from None
        p.staged = None
        tr.staging_wait_s += time.perf_counter() - t
