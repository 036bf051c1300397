"""A full fine-tune's sharded checkpoint (torch.distributed.checkpoint: `<checkpoint>/dcp/` + `config.json`) as a
transformer folder in diffusers layout, in one process on any machine — what a run does with its final checkpoint,
and `lorakit convert checkpoint` does for any step's."""

from __future__ import annotations

import json
from pathlib import Path

from lorakit.errors import FileFormatError, InputError
from lorakit.io import atomic_path, save_sharded

DIR = "dcp"


def intact(ck: Path) -> str | None:
    """Why `ck`/dcp cannot be read (None when it can): DCP writes .metadata last, after every rank's shards."""
    if not (Path(ck) / DIR / ".metadata").is_file():
        return f"{Path(ck) / DIR}: no .metadata (the sharded write did not finish)"
    return None


def full_weights(ck: Path) -> dict:
    """The whole model of a sharded checkpoint: name -> tensor (CPU), read without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ck = Path(ck)
    why = intact(ck)
    if why:
        raise InputError(why, "choose a checkpoint whose write finished (it has state.pt)")
    reader = dcp.FileSystemReader(str(ck / DIR))
    try:
        meta = reader.read_metadata()
        model = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in meta.state_dict_metadata.items()
                 if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    except Exception as e:  # DCP reports damaged and missing files as its CheckpointException
        raise FileFormatError(f"{ck / DIR}: the sharded checkpoint does not read ({first_line(e)})",
                              "use an earlier checkpoint") from None
    if not model:
        raise FileFormatError(f"{ck / DIR}: holds no model weights")
    return model


def first_line(e: Exception) -> str:
    """An exception's first line (DCP's messages run to many), at most 300 characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def write_folder(weights: dict, config: dict, folder: Path) -> None:
    """A transformer in diffusers layout: config.json + (sharded) safetensors."""
    save_sharded({k: v.contiguous() for k, v in weights.items()}, folder)
    with atomic_path(Path(folder) / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True, default=list))


def export_checkpoint(ck, out) -> dict:
    """`ck` (a sharded checkpoint) -> `out`, a transformer folder stock diffusers loads.

    Raises:
        InputError: not a finished sharded checkpoint; FileFormatError: damaged.
    """
    ck, out = Path(ck), Path(out)
    if not (ck / DIR).is_dir():
        raise InputError(f"{ck}: not a sharded checkpoint (no {DIR}/ inside)",
                         "a full fine-tune's checkpoint folder, e.g. OUT/checkpoints/step-000500; gathered "
                         "checkpoints already hold transformer/ in diffusers layout")
    if not (ck / "state.pt").is_file():
        raise InputError(f"{ck}: incomplete (no state.pt: its write had not finished)", "use an earlier checkpoint")
    try:
        config = json.loads((ck / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FileFormatError(f"{ck / 'config.json'}: missing or unreadable ({type(e).__name__})") from None
    weights = full_weights(ck)
    write_folder(weights, config, out)
    return {"checkpoint": str(ck), "output": str(out), "tensors": len(weights),
            "bytes": sum(v.numel() * v.element_size() for v in weights.values())}
