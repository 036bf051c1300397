"""Model weight files: diffusers component folder <-> single file, dtype casts, fp8 with per-tensor scales,
resharding with a diffusers-compatible index. Everything is written atomically; nothing is written when the
input is refused.

fp8 (e4m3): each floating-point matrix is stored as `w / s` in float8_e4m3fn with its float32 scale
`s = max|w| / 448` beside it as `<layer>.scale_weight`, plus an empty `scaled_fp8` marker tensor — the layout
of ComfyUI's scaled-fp8 checkpoints. Vectors (norms, biases) keep the source precision (bf16 when cast from
wider). Converting such a file to another dtype multiplies the scales back in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.io import load, read_header, resolve_files, save, save_sharded, shared_tree
from lorakit.models.native import dequantize_scaled_fp8

DTYPES = ("keep", "fp32", "bf16", "fp16", "fp8")
E4M3_MAX = 448.0


def _cast(sd: dict, dtype: str) -> dict:
    import torch

    if dtype == "keep":
        return sd
    if dtype in ("fp32", "bf16", "fp16"):
        dt = torch_dtype(dtype)
        return {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
    out = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, v in sd.items():
        if v.is_floating_point() and v.dim() >= 2 and k.endswith(".weight"):
            w = v.float()
            s = (w.abs().max().clamp(min=1e-12) / E4M3_MAX).reshape(())
            out[k] = (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[k.removesuffix(".weight") + ".scale_weight"] = s.to(torch.float32)
        elif v.is_floating_point() and v.element_size() > 2:
            out[k] = v.to(torch.bfloat16)
        else:
            out[k] = v
    return out


def convert_model(src, dst, dtype: str = "keep", shard_gb: float | None = None) -> dict:
    """Convert one component's weights. `dst` ending in .safetensors: one file; otherwise a folder (sharded
    above `shard_gb`, with `config.json` copied from a source folder)."""
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not src.exists():
        raise InputError(f"no such file or folder: {src}")
    if dst.exists():
        raise InputError(f"{dst} exists", "name a new output (nothing is overwritten)")
    files = resolve_files(src)
    meta = read_header(files[0]).metadata or {}
    sd = load(files, copy=True)
    if "scaled_fp8" in sd and dtype != "keep":
        sd, _ = dequantize_scaled_fp8(sd)
    sd = _cast(sd, dtype)
    meta = {**meta, "format": "pt", "lorakit_converted_from": src.name, "lorakit_dtype": dtype}
    total = sum(v.numel() * v.element_size() for v in sd.values())
    if dst.suffix == ".safetensors":
        dst.parent.mkdir(parents=True, exist_ok=True)
        written = [save(sd, dst, metadata=meta)]
    else:
        import tempfile

        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        try:
            if src.is_dir() and (src / "config.json").is_file():
                shutil.copy2(src / "config.json", tmp / "config.json")
            base = "diffusion_pytorch_model"
            if src.is_dir() and any(src.glob("model*.safetensors*")) and not any(src.glob(f"{base}*")):
                base = "model"  # transformers components
            limit = int(shard_gb * 2**30) if shard_gb else 5 * 2**30
            save_sharded(sd, tmp, base=base, max_shard_bytes=limit, metadata=meta)
            shared_tree(tmp)  # mkdtemp makes 0700 and a copy keeps its source's mode: readable as any new file
            tmp.rename(dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written = sorted(str(p) for p in dst.iterdir())
    return {"input": str(src), "output": str(dst), "dtype": dtype, "tensors": len(sd),
            "bytes": total, "files": [str(p) for p in written]}


def describe(path) -> dict:
    """What a weights file or folder holds (for messages)."""
    hs = [read_header(f) for f in resolve_files(path)]
    dtypes: dict = {}
    for h in hs:
        for t in h.tensors.values():
            dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
    return {"files": len(hs), "tensors": sum(len(h.tensors) for h in hs), "dtypes": dtypes,
            "scaled_fp8": any("scaled_fp8" in h.tensors for h in hs)}


