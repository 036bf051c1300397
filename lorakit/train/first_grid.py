"""The step-0 sample grid kept between runs: the untrained LoRA's grid is the base model's, so a run whose grid
would be rendered from the same inputs as an earlier run's on this machine shows that grid instead of rendering
it again (FLUX.1-dev 1024², four prompts at 20 steps: 19-20 s on one H200; Qwen-Image 24 GiB: 44 s on an H100).

What decides the picture is the key (`key`): lorakit's, torch's and diffusers' versions, the source of the sampler
and of the family's adapter, and the GPU; the family and the files of the transformers it samples with (both experts
of Wan 2.2 A14B) and the VAE (`Adapter.identity`: configs, sizes, the first and last MiB of each weight file); the
sample conditions as encoded (prompt embeddings, control latents, the empty caption: the prompts, the text encoders
and the control images in one); the sampler's steps, guidance and seed; the weights' storage and compute (dtype,
8-bit base, fp8 products), the attention backend in force, the method, the LoRA type, and the trained tensors
themselves — where every LoRA `B` is zero (the default start), the `A` tensors enter by shape only: the product with
a zero `B` is zero whatever `A` holds, so runs with another global seed share their grid. Change any of these and
the grid is rendered again.
One process only (ranks of a sharded run render together; they must not decide apart)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from lorakit import __version__
from lorakit.paths import cache_root, write_whole
from lorakit.train import sampling
from lorakit.train.lora import lora_state_dict

KEEP = 64  # grids kept in the cache, the newest by use
VERSION = 1  # bump when what renders a grid changes its picture


def folder() -> Path:
    return cache_root() / "grids"


def key(r) -> str:
    """The step-0 grid's key for this run as it stands (its trained tensors as they are now: call it with the
    initial weights in place)."""
    import diffusers
    import torch

    tr, cfg = r.trainer, r.resolved.cfg
    m, s = cfg.memory, cfg.sampling
    dev = torch.cuda.get_device_name(torch.device(tr.device)) if tr.device.startswith("cuda") else "cpu"
    code = [_source(sampling), _source(type(tr.adapter))]  # the sampler and the family's `predict`, as they are
    facts = {"v": VERSION, "lorakit": __version__, "torch": torch.__version__, "diffusers": diffusers.__version__,
             "code": code, "device": dev, "family": cfg.model.family,
             "model": tr.adapter.identity((*_transformers(tr.adapter), tr.adapter.vae_part)),
             "sampling": [s.steps, s.guidance, s.seed], "cell": r.sampler.cell,
             "storage": [cfg.model.dtype, m.base_quant, m.compute, m.attention], "method": cfg.method,
             "lora": [cfg.lora.type, cfg.lora.is_dora] if not tr.full else None,
             "conds": _conds(r.sampler.conds), "weights": None if tr.full else _weights(tr)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cached(k: str) -> Path | None:
    """The grid kept under `k` (its use noted: the newest used are kept), or None."""
    p = folder() / f"{k}.png"
    if not p.is_file():
        return None
    try:
        os.utime(p)
    except OSError:
        pass
    return p


def keep(k: str, grid: Path) -> None:
    """Keep the grid just rendered under `k`; the oldest beyond `KEEP` go. An unwritable cache costs only a render
    next time."""
    d = folder()
    if not write_whole(d / f"{k}.png", lambda tmp: shutil.copyfile(grid, tmp)):
        return
    try:
        kept = sorted(d.glob("*.png"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def _transformers(adapter) -> tuple[str, ...]:
    """The transformer folders a grid is sampled with: every expert's (Wan 2.2 A14B samples with both, whichever
    one trains), else the one."""
    return tuple(adapter.trained_part(e) for e in adapter.experts) or (adapter.trained_part(),)


def _source(obj) -> str:
    """The digest of the source file that defines `obj` (a module or a class); empty where it has none."""
    import inspect

    try:
        return hashlib.sha256(Path(inspect.getsourcefile(obj)).read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def _digest(h, t) -> None:
    import torch

    t = t.detach().to("cpu").contiguous()
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes())


def _walk(h, v) -> None:
    import torch

    if isinstance(v, torch.Tensor):
        _digest(h, v)
    elif isinstance(v, dict):
        for k in sorted(v):
            h.update(str(k).encode())
            _walk(h, v[k])
    elif isinstance(v, (list, tuple)):
        h.update(f"[{len(v)}".encode())
        for x in v:
            _walk(h, x)
    else:
        h.update(repr(v).encode())


def _conds(conds) -> str:
    h = hashlib.sha256()
    for c in conds:
        _walk(h, [c.label, c.text, list(c.shape), c.controls, c.uncond])
    return h.hexdigest()


def _weights(tr) -> str:
    """The trained tensors now (LoRA: `A` by shape alone where every `B` is zero)."""
    sd = lora_state_dict(tr.transformer)
    bs = [v for k, v in sd.items() if ".lora_B." in k]
    zero_b = bool(bs) and not any(bool(b.any()) for b in bs)
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        if zero_b and ".lora_A." in k:
            h.update(str(tuple(sd[k].shape)).encode())
        else:
            _digest(h, sd[k])
    return h.hexdigest()
