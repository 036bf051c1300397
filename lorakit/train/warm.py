"""Every bucket shape compiled before the run meets it, and a second run that starts steady.

A run's compiled blocks need one graph per input shape (each bucket of the dataset, its control sizes). Met one
by one, each new bucket stopped a later step for the compiler (FLUX.1 1024² on an H100: ~50 s per shape cold,
~8 s from this machine's compile cache) — or, with the background compile, slowed every step while it compiled.
Right after step 1, `warm_shapes` runs one forward and backward pass of each other bucket shape (one cached item
of it, repeated to the batch size; the random state, the gradients and the step unchanged): where the blocks compile
in the run, they compile now, in one phase the log names; with the background compile, every shape is handed to
the worker at once, so it switches to the compiled blocks before the run could meet a new shape.

`warm_key` names what a compile depends on (torch, lorakit, the GPU, the transformer's config, the LoRA, dtype and
the memory plan); once a run has compiled every shape of its data, `remember` records them under that key in the
compile cache's folder. A later run with the same key on this machine finds its graphs there, so it compiles at
step 1 and before step 2 in seconds: `known` tells setup to compile in the run instead of in the background (whose
uncompiled steps beside the worker are the slow ones), and the run is steady from step 2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lorakit
from lorakit.errors import LorakitError
from lorakit.hardware.gpu import compile_cache_dir
from lorakit.io import atomic_path
from lorakit.models.base import trained_dir
from lorakit.models.batch import Batch

FOLDER = "warm"  # under the compile cache: one JSON per key, the shapes compiled with it


def warm_key(cfg, device: str) -> str:
    """What a run's compiled graphs depend on, hashed: versions, the card, the transformer's config, the LoRA, the
    dtype and the memory plan (the settings that only choose how the compile runs are left out)."""
    import torch

    try:
        config = (trained_dir(cfg) / "config.json").read_text(encoding="utf-8")
    except OSError:
        config = str(cfg.model.path)
    card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    memory = cfg.memory.model_dump(mode="json", exclude={"compile_background", "loader", "cache_in_memory",
                                                         "free_encoders_after_cache"})
    facts = {"torch": torch.__version__, "lorakit": lorakit.__version__, "card": card, "family": cfg.model.family,
             "config": config, "dtype": cfg.model.dtype, "method": cfg.method, "batch": cfg.schedule.batch_size,
             "lora": cfg.lora.model_dump(mode="json"), "memory": memory,
             "graphs": "the data's varying sizes symbolic from the first compile, carried inputs with gradients, "
                       "joined where later calls get them joined (train.dims)"}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _file(key: str) -> Path:
    return Path(compile_cache_dir()) / FOLDER / f"{key}.json"


def recorded(key: str) -> bool:
    """Did a run with this key compile any shape on this machine?"""
    return _file(key).is_file()


def known(key: str, sizes: set[str]) -> bool:
    """Did a run with this key compile every one of these shapes on this machine (its graphs in the cache)?"""
    try:
        got = set(json.loads(_file(key).read_text(encoding="utf-8")).get("sizes", []))
    except (OSError, ValueError, AttributeError):
        return False
    return bool(sizes) and sizes <= got


def remember(key: str, sizes: set[str]) -> None:
    """Record that these shapes are compiled under `key` (merged with what was recorded; best effort: a cache that
    cannot be written only means the next run compiles in the background again)."""
    f = _file(key)
    try:
        before = set(json.loads(f.read_text(encoding="utf-8")).get("sizes", [])) if f.is_file() else set()
    except (OSError, ValueError, AttributeError):
        before = set()
    try:
        with atomic_path(f) as tmp:
            tmp.write_text(json.dumps({"sizes": sorted(before | sizes)}), encoding="utf-8")
    except (OSError, LorakitError):
        pass


def pixels(adapter, shape) -> str:
    """A batch's size as the step records name it: "WxH" in pixels (+ "xF latent frames" for video)."""
    f = adapter.vae_factor
    size = f"{shape[-1] * f}x{shape[-2] * f}"
    return size + (f"x{shape[-3]} latent frames" if len(shape) == 5 else "")


def shapes(data, adapter) -> dict[str, str]:
    """size -> one item key of it, for each bucket shape the run trains on (one item read per bucket)."""
    first: dict[tuple, str] = {}
    for key, group in data.group.items():
        first.setdefault(group, key)
    out: dict[str, str] = {}
    for key in first.values():
        out.setdefault(pixels(adapter, data.load([key]).latents.shape), key)
    return out


def text_varies(adapter, batch) -> bool:
    """Does this family's text length follow the caption (its prompts are not padded to one length)? FLUX pads every
    prompt to 512 tokens; Qwen-Image, Z-Image and Kandinsky 5 keep each prompt's own length."""
    emb = batch.text.get("prompt_embeds")
    most = adapter.max_sequence_length
    return emb is not None and emb.dim() == 3 and most is not None and 1 < emb.shape[1] < most


def shorter_text(batch):
    """The batch with its text one token shorter (the prompt and its mask): a length no caption gave yet."""
    n = batch.text["prompt_embeds"].shape[1]
    text = {k: (v[:, : n - 1] if k in ("prompt_embeds", "prompt_embeds_mask") and v.dim() >= 2 and v.shape[1] == n
                else v) for k, v in batch.text.items()}
    return Batch(batch.keys, batch.latents, text, batch.controls, batch.mask, batch.weights)


def padded_text(batch):
    """The batch with its first prompt one token shorter than the others, padded to their length: a text mask that
    masks something, as a batch of captions of different lengths carries (`models.batch.drop_full_mask` leaves out
    one that masks nothing)."""
    import torch

    emb = batch.text["prompt_embeds"].clone()
    mask = batch.text.get("prompt_embeds_mask")
    mask = torch.ones(emb.shape[:2], dtype=torch.long) if mask is None else mask.clone()
    emb[0, -1:] = 0
    mask[0, -1:] = 0
    return Batch(batch.keys, batch.latents, {**batch.text, "prompt_embeds": emb, "prompt_embeds_mask": mask},
                 batch.controls, batch.mask, batch.weights)


def to_warm(tr, skip: set[str]) -> list[tuple[str, object]]:
    """What `warm_shapes` runs: (label, batch) for each bucket shape not in `skip`, and first, where the family's text
    length follows the caption, the size in `skip` with its text one token shorter. Torch compiles the blocks for
    the sizes it meets, and at the second length of a size it compiles them for any length (the size symbolic):
    without that pass, the first step whose caption had another length waited for the compiler (Qwen-Image 24 GiB
    on an H100, 2026-11-26: 39.9 s at step 4, after every bucket shape had been compiled).
    Last, where batches hold several prompts of such a family, one batch whose prompts differ in length: its text
    mask is another graph, which the run met only at such a step (tiny Qwen-Image, batch 2, 2026-11-29: the two
    graphs of the masked blocks were all a separate compile process had not compiled)."""
    out = []
    started = None  # step 1's size and a batch of it, where its text length varies
    for size, key in shapes(tr.data, tr.adapter).items():
        batch = tr.data.load([key] * tr.cfg.schedule.batch_size)
        if size in skip:
            if text_varies(tr.adapter, batch):
                out.insert(0, (f"{size} (text of another length)", shorter_text(batch)))
                started = (size, batch)
        else:
            out.append((size, batch))
    if started and tr.cfg.schedule.batch_size > 1:  # after the others: every size that varies is symbolic by then
        out.append((f"{started[0]} (prompts of different lengths)", padded_text(started[1])))
    return out


def variants(tr) -> list:
    """One batch of each bucket shape the run trains on, and, where the family's text length follows the caption,
    the first with its text one token shorter: what `train.dims` compares to find the sizes that vary."""
    out = [tr.data.load([key] * tr.cfg.schedule.batch_size) for key in shapes(tr.data, tr.adapter).values()]
    if out and text_varies(tr.adapter, out[0]):
        out.append(shorter_text(out[0]))
    return out


def warm_shapes(tr, todo: list[tuple[str, object]]) -> list[str]:
    """One forward and backward of each batch of `to_warm`'s list (at sigma 0.5 with noise from its own generator): the
    compiled blocks compile for it now, or the background compile is handed it. The random number generators, the
    trained weights' gradients and the step are as before. Returns the labels warmed."""
    import torch

    cpu_rng = torch.random.get_rng_state()
    cuda = tr.device.startswith("cuda")
    cuda_rng = torch.cuda.get_rng_state(torch.device(tr.device)) if cuda else None
    done = []
    try:
        gen = torch.Generator().manual_seed(0)
        for label, batch in todo:
            n = batch.latents.shape[0]
            noise = torch.randn(batch.latents.shape, generator=gen)
            tr.loss_on(batch, torch.full((n,), 0.5), noise).backward()
            tr.opt.zero_grad(set_to_none=True)  # not summed into the next pass's: with CUDA graphs these gradients
            done.append(label)  # are the graphs' outputs, which the next pass overwrites
    finally:
        tr.opt.zero_grad(set_to_none=True)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, torch.device(tr.device))
    return done
