"""Single-file checkpoints as people have them — FLUX.1's `flux1-dev.safetensors` (Black Forest Labs' names),
ComfyUI's split diffusion-model files (`qwen_image_bf16.safetensors`, fp8 and scaled fp8 too) and all-in-one
checkpoints, diffusers-named files — made into a model folder once: the file's transformer converted to diffusers'
names and checked against the base model's transformer class, beside the base's other components (text encoders,
VAE, scheduler, linked, not copied). The folder lives under the lorakit cache and is reused while the file is
unchanged; every run then loads it as it loads a downloaded model, at lorakit.io's speed.

Every key of the file is converted, or reported by name: the transformer's are checked against the model (missing,
extra and wrongly shaped ones refused, named), other components' (an all-in-one file's VAE and text encoders) are
counted and named as not used, because the base's are.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from lorakit.errors import EnvironmentFault, FileFormatError, InputError
from lorakit.events import Events
from lorakit.io import clean_orphans, load, read_header, save_sharded, shared_tree
from lorakit.io.lock import FolderLock, holder
from lorakit.io.modules import expected_shapes
from lorakit.models.native import dequantize_scaled_fp8, diffusers_weights
from lorakit.models.registry import FAMILIES, arch_of, family_of_pipeline
from lorakit.paths import cache_root

SUFFIXES = (".safetensors", ".sft")
FORMAT = 1  # bump when the conversion changes: folders made by an older one are made again
DONE = "lorakit-single-file.json"
# where the transformer sits in ComfyUI's and the original trainers' checkpoints
TRANSFORMER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# the other components an all-in-one checkpoint carries (the base's are used)
OTHER_PARTS = ("text_encoders.", "cond_stage_model.", "conditioner.", "first_stage_model.", "vae.")


def is_single_file(path) -> bool:
    p = Path(path)
    return p.suffix in SUFFIXES and p.is_file()


def _groups(keys: list[str]) -> dict[str, int]:
    """`vae.*` / `text_encoders.t5xxl.*` -> tensor count."""
    out: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        g = ".".join(parts[:2] if parts[0] in ("text_encoders", "conditioner") and len(parts) > 2 else parts[:1])
        out[g + ".*"] = out.get(g + ".*", 0) + 1
    return out


def split_keys(keys) -> tuple[str, list[str], list[str], list[str]]:
    """(the transformer's prefix, its keys, other components' keys, keys of neither)."""
    keys = list(keys)
    others = [k for k in keys if k.startswith(OTHER_PARTS)]
    rest = [k for k in keys if not k.startswith(OTHER_PARTS)]
    prefix = next((p for p in TRANSFORMER_PREFIXES if any(k.startswith(p) for k in rest)), "")
    transformer = [k for k in rest if k.startswith(prefix)]
    stray = [k for k in rest if not k.startswith(prefix)]
    return prefix, transformer, others, stray


def _named(keys, n: int = 4) -> str:
    keys = list(keys)
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _dequantize(sd: dict, notes: list[str], name: str) -> dict:
    """ComfyUI's scaled fp8, made plain (said in `notes`)."""
    sd, done = dequantize_scaled_fp8(sd)
    if done["orphans"]:
        k = done["orphans"][0]
        raise FileFormatError(f"{name}: {k} scales no weight ({k.removesuffix('.scale_weight')}.weight is not in "
                              "the file)")
    if done["scaled"] or done["inputs"] or done["marker"]:
        notes.append(f"{name}: scaled fp8 — {done['scaled']} weights multiplied by their scale_weight and kept in bf16"
                     + (f"; {done['inputs']} scale_input values not used (fp8 matmul input scales: lorakit computes "
                        "in bf16)" if done["inputs"] else ""))
    return sd


def transformer_weights(path: Path, family: str, transformer_dir: Path) -> tuple[dict, list[str]]:
    """The file's transformer in diffusers' names, checked against the base's transformer class.

    Returns:
        (state dict mapped from the file, notes on what was converted or left out).

    Raises:
        FileFormatError: damaged file; InputError: the file does not fit the base model (keys named).
    """
    name = path.name
    header = read_header(path)
    prefix, keys, others, stray = split_keys(header.tensors)
    notes: list[str] = []
    if stray:
        raise InputError(f"model.path: {path}: {len(stray)} keys belong to no part lorakit knows "
                         f"(the transformer's are under {prefix!r}): {_named(stray)}",
                         "give the diffusion model's own file (ComfyUI: models/diffusion_models or a checkpoint)")
    if not keys:
        raise InputError(f"model.path: {path} holds no diffusion transformer (only {_named(_groups(others))})",
                         "give the diffusion model's file; text encoder and VAE files come from model.base")
    if others:
        groups = _groups(others)
        notes.append(f"{name}: not used, model.base's are — " + ", ".join(f"{g} ({n} tensors)"
                                                                          for g, n in groups.items()))
    sd = {k[len(prefix):]: v for k, v in load(path, keys=keys).items()}
    sd = _dequantize(sd, notes, name)
    stored = sorted({str(v.dtype).removeprefix("torch.") for v in sd.values() if v.is_floating_point()})
    if any(d.startswith("float8") for d in stored):
        notes.append(f"{name}: weights stored in {'/'.join(stored)}; the run computes in its model dtype from "
                     "these values (a LoRA trained on an fp8 file learns against the fp8-rounded base)")
    sd, _ = diffusers_weights(sd, arch_of(family))
    want = expected_shapes(transformer_dir)
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    shapes = [f"{k} {tuple(sd[k].shape)} (the model: {want[k]})" for k in want
              if k in sd and tuple(sd[k].shape) != want[k]]
    if missing or extra or shapes:
        parts = ([f"missing {len(missing)}: {_named(missing)}"] if missing else []) + \
                ([f"not in the model {len(extra)}: {_named(extra)}"] if extra else []) + \
                ([f"other shapes {len(shapes)}: {_named(shapes, 2)}"] if shapes else [])
        raise InputError(f"model.path: {path} does not fit model.base's transformer ({transformer_dir}, a "
                         f"{family} model): " + "; ".join(parts),
                         "model.base must be the model the file was made from (black-forest-labs/FLUX.1-dev for "
                         "flux1-dev.safetensors, Qwen/Qwen-Image for qwen_image_*.safetensors), and model.family "
                         "its family")
    return sd, notes


def _key(file: Path, base: Path) -> str:
    st = file.stat()
    text = f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{base.resolve()}\0{FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def compose(file, base, family: str, events: Events | None = None) -> tuple[Path, list[str]]:
    """The model folder for a single-file checkpoint and its base: made on first use, reused after.

    Args:
        file: the single-file checkpoint (.safetensors).
        base: the diffusers model folder whose other components go with it (model_index.json inside).
        family: the model family (which names the file uses).

    Returns:
        (the folder, notes on the conversion).

    Raises:
        InputError: the file does not fit the base; EnvironmentFault: no room for the converted transformer.
    """
    file, base = Path(file), Path(base)
    events = events or Events()
    if not (base / "model_index.json").is_file() or not (base / "transformer" / "config.json").is_file():
        raise InputError(f"model.base: {base} is not a diffusers model folder (model_index.json and "
                         "transformer/config.json inside)", "a Hugging Face repo id or the downloaded folder")
    _same_family(base, family)  # before the conversion (a 23 GB transformer is converted for nothing otherwise)
    root = cache_root() / "models"
    target = root / f"{file.stem}-{_key(file, base)}"
    if (target / DONE).is_file():
        return target, json.loads((target / DONE).read_text())["notes"]
    target.mkdir(parents=True, exist_ok=True)
    with FolderLock(target, "single-file conversion", "another lorakit command is converting this file: wait "
                                                      "for it, then run again (the result is reused)"):
        if (target / DONE).is_file():  # made while this one waited
            return target, json.loads((target / DONE).read_text())["notes"]
        clean_orphans(target, recursive=True)  # a killed conversion's temporary files (up to the transformer's size)
        with events.phase(f"convert {file.name}") as facts:
            sd, notes = transformer_weights(file, family, base / "transformer")
            size = sum(v.numel() * v.element_size() for v in sd.values())
            free = shutil.disk_usage(target).free
            if free < size + 2**30:
                raise EnvironmentFault(f"model.path: converting {file} needs {size / 2**30:.1f} GiB in {target}; "
                                       f"{free / 2**30:.1f} GiB are free",
                                       "free space there, or set LORAKIT_CACHE to a disk with room")
            t0 = time.perf_counter()
            save_sharded(sd, target / "transformer", metadata={"lorakit_source": file.name})
            shutil.copyfile(base / "transformer" / "config.json", target / "transformer" / "config.json")
            for entry in base.iterdir():
                if entry.name in ("transformer", DONE) or entry.name.startswith("."):
                    continue
                link = target / entry.name
                if entry.name == "model_index.json":
                    shutil.copyfile(entry, link)
                elif not link.exists():
                    link.symlink_to(entry.resolve())
            facts.update(gib=round(size / 2**30, 2), gb_per_s=round(size / 1e9 / max(time.perf_counter() - t0, 1e-9),
                                                                    2), folder=str(target))
        notes.append(f"model.path: {file} converted once to {target} ({size / 2**30:.1f} GiB; later runs reuse it "
                     f"while the file is unchanged), with model.base {base}'s other components")
        (target / DONE).write_text(json.dumps({"source": str(file.resolve()), "base": str(base.resolve()),
                                               "format": FORMAT, "notes": notes}, indent=1))
        shared_tree(target)
    _drop_stale(root, target, file, base)
    return target, notes


def _same_family(base: Path, family: str) -> None:
    """model.base's pipeline is the family's (InputError naming both otherwise)."""
    info = FAMILIES.get(family)
    try:
        got = json.loads((base / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return  # the folder check names an unreadable index
    if info is not None and got != info.pipeline_class:
        theirs = family_of_pipeline(got) if isinstance(got, str) else None
        raise InputError(f"model.base: {base} holds a {got}, not the {info.pipeline_class} that model.family "
                         f"{family} needs", f"set model.family: {theirs}" if theirs else
                         "model.base must be the model the file was made from")


def _drop_stale(root: Path, keep: Path, file: Path, base: Path) -> None:
    """Folders converted from an earlier version of the same file with the same base (they would fill the disk),
    and folders of this file's name whose conversion was killed before it finished (no one holds their lock)."""
    for d in root.glob(f"{file.stem}-*"):
        if d == keep:
            continue
        if not (d / DONE).is_file():
            if d.is_dir() and holder(d) is None:
                shutil.rmtree(d, ignore_errors=True)
            continue
        try:
            made = json.loads((d / DONE).read_text())
            if made.get("source") == str(file.resolve()) and made.get("base") == str(base.resolve()):
                shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError):
            continue
