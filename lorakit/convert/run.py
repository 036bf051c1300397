"""`lorakit convert lora`, as a library function: read any layout, write the asked one, then check the written file
three ways before calling it equal — lorakit's own reading, ComfyUI's rules (`convert/comfy.py`), and for the
diffusers layout diffusers' own loader — and leave nothing behind when the conversion is refused or fails."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from lorakit.convert.compare import deltas_equal
from lorakit.convert.patches import LowRank
from lorakit.convert.read import read
from lorakit.convert.verify import PARTIAL, comfy_probe_check, diffusers_view
from lorakit.convert.write import write
from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.io import load
from lorakit.models.registry import arch_of, family_of_arch

FAILED = 1  # exit code of a conversion whose output reads back otherwise than its input (nothing is kept)


def model_weights(model: Path) -> dict:
    """module -> weight of a model folder's transformer (read through lorakit.io, mapped, no copy)."""
    folder = model / "transformer" if (model / "transformer").is_dir() else model
    if not folder.is_dir():
        raise InputError(f"--model {model}: not a model folder (no transformer/ inside)")
    return {k.removesuffix(".weight"): v for k, v in load(folder).items() if k.endswith(".weight")}


def convert_lora(src: Path, dst: Path, to: str, family: str | None = None, model: Path | None = None,
                 strict: bool = False, dtype: str | None = None) -> dict:
    """Convert; returns the facts of input and output and each check. `result["equal"]` is True only when every
    check that could run said equal; otherwise the output has been removed.

    Raises:
        InputError: the input cannot be read, or the asked layout cannot hold what it carries (nothing written).
    """
    src, dst = Path(src), Path(dst)
    if src.exists() and dst.exists() and src.resolve() == dst.resolve():
        raise InputError(f"{dst} would overwrite its input", "name another output")
    if not src.exists():
        raise InputError(f"no such file or folder: {src}")
    existed = dst.exists()
    arch = arch_of(family) if family else None
    base = model_weights(model) if model else None
    lora_in = read(src, arch=arch, strict=strict, base=base)
    arch = arch or lora_in.facts["arch"]
    try:
        out = write(lora_in, dst, to, arch, dtype=torch_dtype(dtype) if dtype else None, base=base)
        back = read(out, arch=arch, base=base)
        rtol = 1e-6 if dtype in (None, "fp32") else 1e-2
        ok, why = deltas_equal(lora_in, back, rtol=rtol, base=base)
        checks = {"lorakit": why}
        if ok:
            checks.update(_consumers(out, to, arch, lora_in, base, rtol))
    except BaseException:
        if not existed:
            _remove(dst)
        raise
    equal = ok and all(v == "equal" or v.startswith(("not compared", ELSEWHERE, PARTIAL)) for v in checks.values())
    if not equal and not existed:
        _remove(dst)  # a file that reads back otherwise than its input is not kept
    return {"input": {"path": str(src), **lora_in.facts}, "output": {"path": str(out), **back.facts,
                                                                       "kept": equal or existed},
            "equal": equal, "deltas_equal": equal, "checks": checks, "check": _summary(checks),
            "compared": len(lora_in.weights) + len(lora_in.biases),
            "not_converted": [{"key": k, "why": w} for k, w in lora_in.unused]}


def _consumers(out: Path, to: str, arch: str | None, expected, base, rtol: float) -> dict:
    """ComfyUI's reading of the output (and diffusers' for the diffusers layout) against what the input means."""
    checks = {}
    dora = any(getattr(p, "dora", False) for p in expected.weights.values())
    if arch is None:
        checks["comfyui"] = "not compared: the architecture is unknown (pass --family)"
    elif dora and not base:
        checks["comfyui"] = "not compared: DoRA needs the base weights (--model)"
    elif to == "peft":
        checks["comfyui"] = "not compared: ComfyUI does not read peft folders"
    else:
        checks["comfyui"] = comfy_probe_check(out, arch, expected, base, rtol).replace("convert FILE", f"convert {out}")
    plain = all(isinstance(p, LowRank) for p in expected.weights.values()) and not expected.biases
    if to == "diffusers" and arch is not None and plain and (base or not dora):
        view = diffusers_view(out, family_of_arch(arch))
        checks["diffusers"] = deltas_equal(expected.weights, view.weights, rtol=rtol, base=base)[1]
    elif to in ("kohya", "comfyui") and arch is not None and plain and not dora:
        checks["diffusers"] = _also_diffusers(out, arch, expected, rtol)
    return checks


ELSEWHERE = "read otherwise by diffusers"  # a layout made for ComfyUI/kohya that diffusers' own reader gets wrong


def _also_diffusers(out: Path, arch: str, expected, rtol: float) -> str:
    """How diffusers' own converters read a ComfyUI/kohya file (told, not required: those layouts are for other
    consumers; e.g. diffusers 0.42's FLUX.2 readers mis-swap or drop the final norm's modulation)."""
    level = logging.getLogger("diffusers").level
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # its converters warn about keys they drop: said below
    try:
        view = diffusers_view(out, family_of_arch(arch))
    except Exception as e:  # noqa: BLE001 - a reader that refuses the layout is a fact to report
        return f"not compared: diffusers' reader for this layout failed on it ({type(e).__name__}: {str(e)[:80]})"
    finally:
        logging.getLogger("diffusers").setLevel(level)
    ok, why = deltas_equal(expected.weights, view.weights, rtol=rtol)
    if ok:
        return "equal"
    missing = sorted(set(expected.weights) - set(view.weights))
    what = f"it drops {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") if missing \
        else why
    return f"{ELSEWHERE}: {what} (for diffusers write --to diffusers)"


def _summary(checks: dict) -> str:
    """"equal (the readers that read it whole)", then what each other reader does with it — a reader not compared
    or reading part is named, never folded into "equal"."""
    bad = {k: v for k, v in checks.items() if v != "equal" and not v.startswith(("not compared", ELSEWHERE, PARTIAL))}
    if bad:
        return "; ".join(f"{k}: {v}" for k, v in bad.items())
    rest = "".join(f"; {k}: {v}" for k, v in checks.items() if v != "equal")
    return "equal (" + ", ".join(k for k, v in checks.items() if v == "equal") + ")" + rest


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
