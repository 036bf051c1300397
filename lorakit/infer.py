"""Generation with a base model and LoRAs: the family's stock diffusers pipeline, assembled from components
loaded through `lorakit.io`, LoRAs in any supported layout (read by `convert.lora`, handed to diffusers'
own LoRA loader with their rank and alpha), each image from its own seeded generator so any one of them can
be made again alone. PNGs carry prompt, seed, steps, guidance, model and LoRA hashes in text chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lorakit import __version__, placement
from lorakit.convert import lora as L
from lorakit.convert.patches import LowRank
from lorakit.data.images import open_image
from lorakit.data.video import write_clip
from lorakit.dtypes import float32_inside, slow_on_cpu, torch_dtype
from lorakit.errors import InputError
from lorakit.hardware.gpu import apply_cap, budget_gib
from lorakit.io import atomic_path
from lorakit.io.digest import file_hash
from lorakit.models.base import family_adapter, load_adapter
from lorakit.models.grid import sampling_steps
from lorakit.models.registry import family_info, family_names, family_of_folder
from lorakit.placement import apply, transformer_parts


@dataclass
class Request:
    prompts: list[str]
    seed: int = 0
    steps: int | None = None  # None: the model's own sampling grid (its pipeline's sample_sigmas) where it has one,
    guidance: float | None = None
    negative: str | None = None
    width: int | None = None
    height: int | None = None
    batch: int = 1
    images: list[Path] = field(default_factory=list)
    frames: int = 17
    fps: float = 24.0  # video: the rate written into the .mp4 / GIF
    offload: str = "auto"  # lorakit.placement: none | model | fp8 | group, auto by the weights and the card


def parse_lora(spec: str) -> tuple[Path, float]:
    """"path" or "path:scale"."""
    path, _, scale = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    try:
        s = float(scale) if scale else 1.0
    except ValueError:
        raise InputError(f"--lora {spec!r}: the scale after ':' must be a number",
                         "e.g. --lora my.safetensors:0.8") from None
    p = Path(path)
    if not p.exists():
        raise InputError(f"--lora: no such file: {p}")
    return p, s


def assemble(model_dir: Path, device: str, dtype, backend: str = "auto"):
    """The family's stock pipeline over every component, weights loaded through lorakit.io (the family
    adapter's loading). Returns (pipeline, adapter)."""
    adapter = load_adapter(family_of_folder(model_dir), model_dir, device=device, dtype=dtype, backend=backend)
    adapter.load([k for k in adapter.index if not k.startswith("_")])
    pipe = adapter.pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe, adapter


def read_loras(loras: list[tuple[Path, float]], arch: str | None) -> list[tuple]:
    """Read and check every LoRA (any layout) before anything heavy is loaded: (path, scale, Lora)."""
    return [(path, scale, L.read(path, arch=arch)) for path, scale in loras]  # another architecture: refused


def add_loras(pipe, loras: list[tuple], arch: str | None, bake: bool = False, defer: dict | None = None) -> list[dict]:
    """Apply each LoRA to the pipeline's transformer at its scale: LoRA and DoRA modules as peft adapters (one
    per file, as `load_lora_weights` makes them); what peft cannot hold — LyCORIS LoKr/LoHa, full and bias
    differences, ComfyUI-convention DoRA — is added into the weights (W += scale * delta), as ComfyUI does;
    with `bake`, everything is (weights about to be stored in 8 bits). `defer`: transformer part -> module name
    -> list, for the layers about to be rounded to 8 bits: a plain LoRA on one is appended there as (B, A,
    coefficient) for the rounding pass to sum on the GPU (`train.quant.quantize_blocks`). `loras`: paths and
    scales, or what `read_loras` returned."""

    read = loras if loras and len(loras[0]) == 3 else read_loras(loras, arch)
    names: dict = {}  # component -> (adapter names, scales)
    facts = []
    for i, (path, scale, lora) in enumerate(read):
        parts, why = expert_parts(pipe, path, lora)
        baked = 0
        for part in parts:
            baked = _add_one(pipe, part, i, path, scale, lora, bake, (defer or {}).get(part), names)
        facts.append({"path": str(path), "scale": scale, "sha256_16": file_hash(path), **lora.facts,
                      "added_to_weights": baked + len(lora.biases),
                      **({"applied_to": parts, "applied_to_why": why} if why else {}),
                      "not_applied": [{"key": k, "why": w} for k, w in lora.unused]})
    for part, (ns, scales) in names.items():
        getattr(pipe, part).set_adapters(ns, scales)  # each expert its own adapters (diffusers' pipeline-level
    return facts  # set_adapters wants every name in every expert)


EXPERT_NAMES = {"high": "transformer", "low": "transformer_2"}


def expert_parts(pipe, path: Path, lora) -> tuple[list[str], str]:
    """The transformers of the pipeline a LoRA applies to, and why where there is a choice (Wan 2.2 A14B: the expert
    the file names in its metadata (lorakit_expert) or its name (`_high_noise` / `_low_noise`, as ai-toolkit and
    musubi-tuner name theirs), else both experts)."""
    if getattr(pipe, "transformer_2", None) is None:
        return ["transformer"], ""
    expert = lora.facts.get("expert")
    if expert in EXPERT_NAMES:
        return [EXPERT_NAMES[expert]], f"the {expert}-noise expert, as the file's metadata says (lorakit_expert)"
    stem = Path(path).stem.lower()
    for expert in EXPERT_NAMES:
        if f"{expert}_noise" in stem or f"{expert}noise" in stem or stem.endswith(f"_{expert}"):
            return [EXPERT_NAMES[expert]], f"the {expert}-noise expert, as the file's name says"
    return list(EXPERT_NAMES.values()), "both experts: the file names no expert (lorakit_expert, _high_noise/_low_noise)"


def _add_one(pipe, part: str, i: int, path, scale: float, lora, bake: bool, defer, names: dict) -> int:
    """One LoRA into one transformer of the pipeline; returns how many modules went into the weights."""
    import torch

    tr = getattr(pipe, part)
    params = dict(tr.named_parameters())
    missing = [m for m in lora.weights if f"{m}.weight" not in params] + \
              [m for m in lora.biases if f"{m}.bias" not in params]
    if missing:
        raise InputError(f"{path}: modules this model does not have: {', '.join(missing[:3])}",
                         "is the LoRA for another model size or family?")
    peft_ok = {} if bake else {m: p for m, p in lora.weights.items()
                               if isinstance(p, LowRank) and (p.magnitude is not None or p.dora_scale is None)}
    baked = 0
    with torch.no_grad():
        for m, p in lora.weights.items():
            if m in peft_ok:
                continue
            if defer is not None and m in defer and isinstance(p, LowRank) and not p.dora:
                defer[m].append((p.B, p.A, p.scale * scale))  # summed where the layer is rounded to 8 bits
            else:
                w = params[f"{m}.weight"]
                w += (p.delta(w) * scale).to(w.dtype)
            baked += 1
        for m, b in lora.biases.items():
            params[f"{m}.bias"] += (b.double() * scale).to(params[f"{m}.bias"].dtype)
    if peft_ok:
        sd, cfg = L.to_peft(peft_ok)
        sd = {k: v.to(torch.float32) for k, v in sd.items()}
        name = f"lora{i}"
        try:
            # the transformer's own peft loader, given rank and alpha as diffusers reads them from a file
            tr.load_lora_adapter(sd, prefix="transformer", network_alphas=None, adapter_name=name,
                                 metadata={f"transformer.{k}": v for k, v in cfg.items()}, _pipeline=pipe)
        except (ValueError, RuntimeError, KeyError) as e:
            raise InputError(f"{path}: does not fit this model's transformer ({str(e).splitlines()[0][:160]})",
                             "is the LoRA for another model size or family?") from None
        ns, scales = names.setdefault(part, ([], []))
        ns.append(name)
        scales.append(scale)
    return baked


def _to_pil(img):
    from PIL import Image

    if isinstance(img, Image.Image):
        return img
    import numpy as np

    return Image.fromarray((np.asarray(img) * 255).clip(0, 255).astype("uint8"))


def generate(model_dir: Path, req: Request, loras: list[tuple[Path, float]], out_dir: Path, device: str | None = None,
             dtype_name: str | None = None, progress=None) -> dict:
    """Make every image of the request; returns what was written. `progress(message)` hears each phase."""
    import torch
    from PIL.PngImagePlugin import PngInfo

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    apply_cap(device)  # LORAKIT_MEMORY_CAP_GIB: a smaller card, emulated
    dtype_name = dtype_name or ("bf16" if device.startswith("cuda") else "fp32")
    dtype = torch_dtype(dtype_name)
    if not req.prompts:
        raise InputError("no prompt", "give --prompt TEXT (repeatable) or --prompts FILE")

    controls = []
    for p in req.images:  # every input is checked before the model is loaded
        if not Path(p).is_file():
            raise InputError(f"--image {p}: no such file" if not Path(p).exists() else f"--image {p}: not a file")
        try:
            controls.append(open_image(p))
        except InputError as e:
            raise InputError(f"--image {e.message}", e.hint) from None
        except (OSError, ValueError, SyntaxError):
            raise InputError(f"--image {p}: not a readable image") from None
    facts = family_adapter(family_of_folder(model_dir))
    if controls and facts.layout != "edit" and not facts.first_frame:  # one pipeline for both (FLUX.2): reference
        facts = next((family_adapter(f) for f in family_names() if family_info(f).pipeline_class ==  # images make it
                      facts.info.pipeline_class and family_adapter(f).layout == "edit"), facts)  # the edit family
    family, edit, video = facts.family, facts.layout == "edit", facts.layout == "video"
    if edit and not controls:
        raise InputError(f"{family} edits an image", f"give --image PATH (up to {facts.max_controls})")
    if facts.first_frame and len(controls) != 1:
        raise InputError(f"{family} starts each clip from an image: one --image, got {len(controls)}",
                         "give --image PATH (the first frame)")
    if controls and not edit and not facts.first_frame:
        raise InputError(f"{family} takes no --image")
    if len(controls) > max(facts.max_controls, int(facts.first_frame)):
        raise InputError(f"{family} takes at most {facts.max_controls} --image, got {len(controls)}")
    if video and (req.frames < 1 or (req.frames - 1) % facts.temporal):
        t = facts.temporal
        raise InputError(f"--frames {req.frames}: {family} makes {t}k+1 frames",
                         f"e.g. --frames {max(1, (req.frames - 1) // t * t + 1)} or {((req.frames - 1) // t + 1) * t + 1}")
    if req.fps <= 0:
        raise InputError(f"--fps must be positive, got {req.fps:g}")
    read = read_loras(loras, facts.arch)
    import time

    t_load = time.perf_counter()
    say = progress or (lambda msg: None)
    plan = _placement(model_dir, device, dtype, facts, req)
    where = device if plan.mode == "none" else "cpu"
    say(f"loading {sum(plan.sizes_gib.values()):.1f} GiB of weights to {where}" if plan.sizes_gib
        else "loading weights")
    pipe, adapter = assemble(model_dir, where, dtype)
    phases = {"weights_s": round(time.perf_counter() - t_load, 2)}
    fp8 = plan.mode == "fp8"  # 8-bit weights: LoRAs added in first
    if read:
        say(f"adding {len(read)} LoRA(s)" + (" into the weights" if fp8 else ""))
    t = time.perf_counter()
    pending = None
    if fp8:
        from lorakit.train.quant import block_linears

        pending = {part: {name: [] for name in block_linears(getattr(pipe, part))}
                   for part in transformer_parts(pipe)}
    lora_facts = add_loras(pipe, read, adapter.arch, bake=fp8, defer=pending)
    phases["loras_s"] = round(time.perf_counter() - t, 2)

    say(f"placing: {plan.mode} ({plan.why})")
    t = time.perf_counter()
    streamed: dict = {}
    apply(pipe, plan, device, dtype, add=pending, streamed=streamed)
    phases["placement_s"] = round(time.perf_counter() - t, 2)
    vae = getattr(pipe, facts.vae_part, None)
    if vae is not None and slow_on_cpu(device, dtype):  # computes in float32, takes and gives the run's dtype
        float32_inside(vae)
        say(f"{facts.vae_part}: float32 (this CPU has no fast {dtype_name} convolutions: ~60x slower)")
    unpinned = unpinned_warnings(streamed) if str(device).startswith("cuda") else []  # a CPU run pins nothing
    for w in unpinned:
        say(w)
    steps, sigmas, sampling = sampling_steps(pipe, req.steps)
    if sampling:
        say(f"sampling: {sampling}")
    t_gen = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_hash = file_hash(Path(model_dir) / "model_index.json")
    files, images, labels, gifs, k, gen_times = [], [], [], [], 0, []
    total = len(req.prompts) * req.batch
    for prompt in req.prompts:
        for _ in range(req.batch):
            seed = req.seed + k
            kw = dict(prompt=prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                      **({"sigmas": sigmas} if sigmas else {}))
            if req.width or req.height:  # the sizes the family's pipeline takes (Kandinsky 5 T2I: its list)
                w, h = req.width or req.height, req.height or req.width
                kw.update({k: v for k, v in adapter.call_kwargs(w, h, req.frames).items() if k != "num_frames"})
            if req.negative is not None:
                kw["negative_prompt"] = req.negative
            if req.guidance is not None:
                kw[adapter.guidance_arg] = req.guidance
            if controls:
                kw["image"] = controls[0] if adapter.max_controls == 1 or adapter.first_frame else controls
            if video:
                kw["num_frames"] = req.frames
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t_one = time.perf_counter()
            result = pipe(**kw)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            gen_times.append(time.perf_counter() - t_one)
            info = PngInfo()
            meta = {"prompt": prompt, "negative_prompt": req.negative or "", "seed": seed, "steps": steps,
                    "guidance": req.guidance, "model": str(model_dir), "model_sha256_16": model_hash,
                    "loras": [{"sha256_16": f["sha256_16"], "scale": f["scale"], "path": f["path"]}
                              for f in lora_facts], "lorakit": __version__,
                    **({"base_weights": "fp8 e4m3 blocks (--offload fp8)"} if plan.mode == "fp8" else {})}
            for key, v in meta.items():
                info.add_text(f"lorakit:{key}", v if isinstance(v, str) else json.dumps(v))
            if video:  # an .mp4 (H.264, the metadata in its comment) and a GIF beside it for quick looks

                frames = [_to_pil(f) for f in result.frames[0]]
                path = out_dir / f"{k:04d}-seed{seed}.mp4"
                with atomic_path(path) as tmp:
                    write_clip(tmp, frames, fps=req.fps, metadata={"comment": json.dumps(meta)}, ext=".mp4")
                gif = path.with_suffix(".gif")
                with atomic_path(gif) as tmp:
                    write_clip(tmp, frames, fps=req.fps, ext=".gif")
                gifs.append(str(gif))
                img = frames[len(frames) // 2]
            else:
                images_ = getattr(result, "images", None)
                img = _to_pil((images_ if images_ is not None else result.image)[0])
                path = out_dir / f"{k:04d}-seed{seed}.png"
                with atomic_path(path) as tmp:
                    img.save(tmp, format="PNG", pnginfo=info)
            files.append(str(path))
            images.append(img)
            labels.append(f"{path.name}: {prompt}")
            k += 1
            say(f"{k}/{total} {'clips' if video else 'images'} ({gen_times[-1]:.1f} s)")
    sheet = None
    if len(images) > 1:
        sheet = out_dir / "contact_sheet.png"
        with atomic_path(sheet) as tmp:
            loras = ", ".join(f"{Path(f['path']).name} x{f['scale']:g}" for f in lora_facts) or "no LoRA"
            guidance = "" if req.guidance is None else f", guidance {req.guidance:g}"
            title = f"{Path(model_dir).name} · {loras} · {steps} steps{guidance}"
            contact_sheet(images, labels, title).save(tmp, format="PNG")
    # the median generation (the pipeline call; the first one warms up), and everything per image with saving
    timing = {"seconds_per_image": round(sorted(gen_times)[len(gen_times) // 2], 3) if gen_times else None,
              "generation_s": [round(t, 3) for t in gen_times],
              "wall_per_image_s": round((time.perf_counter() - t_gen) / max(k, 1), 3),
              "load_s": round(t_gen - t_load, 2), **{f"load_{k}": v for k, v in phases.items()},
              "offload": plan.mode, "offload_why": plan.why, **({"streamed": streamed} if streamed else {})}
    if device.startswith("cuda"):
        timing["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return {"files": files, **({"gifs": gifs} if gifs else {}), **timing, "steps": steps,
            **({"sampling": sampling} if sampling else {}),
            "contact_sheet": str(sheet) if sheet else None, "model": str(model_dir),
            "family": family, "device": device, "dtype": dtype_name, "loras": lora_facts,
            **({"vae_compute": "fp32"} if vae is not None and slow_on_cpu(device, dtype) else {}),
            "warnings": not_applied_warnings(lora_facts) + unpinned}


def unpinned_warnings(streamed: dict) -> list[str]:
    """A line per streamed component whose blocks, or some of them, wait in pageable memory (`io.stream`: the host
    had no room to page-lock them beside what it holds): each visit is a slower copy, and where the host's free
    memory cannot hold them either, a read from the disk."""
    out = []
    for name, how in streamed.items():
        if not how or not how.get("streamed_gib") or how.get("pinned"):
            continue
        gib, of = how.get("pageable_gib", how["streamed_gib"]), how["streamed_gib"]
        part = f"{gib:.1f} of its {of:.1f}" if gib < of else f"{gib:.1f}"
        out.append(f"{name}: {part} GiB of blocks stream from pageable memory (the host has no room to page-lock "
                   "them): slower each time it runs, and read again from the disk where the host's free memory "
                   "cannot hold them")
    return out


def not_applied_warnings(lora_facts: list[dict]) -> list[str]:
    """One line per LoRA file with keys that were not applied (e.g. a kohya file's text-encoder part): nothing a
    file holds is dropped without saying so."""
    out = []
    for f in lora_facts:
        skipped = f["not_applied"]
        if skipped:
            whys = sorted({s["why"] for s in skipped})
            out.append(f"{f['path']}: {len(skipped)} key(s) not applied, e.g. {skipped[0]['key']} ({'; '.join(whys)})")
    return out


def _decode(index: dict, facts, req: Request):
    """The VAE's decode of one output of the request (`placement.decode_need`), at the size the pipeline will make:
    the request's, else its own default (None where the VAE's class is not one measured). `index`: the model
    folder's model_index.json."""
    import inspect

    vae = index.get(facts.vae_part)
    if not (isinstance(vae, list) and len(vae) == 2):
        return None
    frames = req.frames if facts.layout == "video" else 1
    if req.width or req.height:
        size = facts.call_kwargs(req.width or req.height, req.height or req.width, frames)
        width, height = size["width"], size["height"]
    else:  # the pipeline's defaults: its __call__'s (Kandinsky 5 T2V: 768x512), else 1024² (FLUX, Qwen-Image: None)
        params = inspect.signature(facts.pipeline_class().__call__).parameters
        width, height = (params[k].default if k in params and isinstance(params[k].default, int) else 1024
                         for k in ("width", "height"))
    return placement.decode_need(vae[1], width, height, frames)


def _placement(model_dir, device: str, dtype, facts, req: Request):
    """Where the weights wait while generating (lorakit.placement), with room for the VAE's decode of the request's
    output (`_decode`); everything on the CPU when device is."""
    mode = req.offload
    if not device.startswith("cuda"):  # the CPU holds everything; fp8 weights only when asked for
        return placement.Plan("fp8", "--offload fp8 on the CPU", {}) if mode == "fp8" else \
            placement.Plan("none", "the CPU", {})
    import torch

    index = json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))
    names = [k for k in index if not k.startswith("_")]  # those with weight files are counted
    nbytes = torch.empty((), dtype=dtype).element_size()
    sizes = placement.component_gib(model_dir, names, nbytes)
    fp8 = {n: placement.fp8_gib(Path(model_dir) / n, nbytes) for n in sizes if n.startswith("transformer")}
    return placement.choose(sizes, budget_gib(device), mode, fp8_sizes=fp8 or None,
                            decode=_decode(index, facts, req))


def contact_sheet(images, labels=None, title: str = "", columns: int = 4, lines: int = 3):
    """The images in a grid, each above its label (its file, seed and prompt, wrapped to the image's width, at most
    `lines` lines: a longer prompt ends in "..."), under a title line (the model and LoRAs)."""
    from PIL import Image, ImageDraw

    labels = labels or [""] * len(images)
    w = max(i.width for i in images)
    h = max(i.height for i in images)
    cols = min(columns, len(images))
    rows = -(-len(images) // cols)
    pad, line_h = 4, 12
    text_h = (lines * line_h + 2 * pad) if any(labels) else 0
    head = (line_h + 2 * pad) if title else 0
    sheet = Image.new("RGB", (cols * w, head + rows * (h + text_h)), "white")
    d = ImageDraw.Draw(sheet)
    if title:
        d.text((pad, pad), _wrap(d, title, cols * w - 2 * pad, 1)[0], fill="black")
    for n, (im, lab) in enumerate(zip(images, labels, strict=True)):
        x, y = (n % cols) * w, head + (n // cols) * (h + text_h)
        sheet.paste(im, (x, y))
        for k, line in enumerate(_wrap(d, lab, w - 2 * pad, lines)):
            d.text((x + pad, y + h + pad + k * line_h), line, fill="black")
    return sheet


def _wrap(draw, text: str, width: float, lines: int) -> list[str]:
    """Words in lines no wider than `width` (a word too long for a line is cut); past `lines`, the last ends in
    "..."."""
    out, cur = [], ""
    for word in text.split():
        while draw.textlength(word) > width and len(word) > 1:  # a word wider than a line: cut it
            word = word[:-1]
        trial = f"{cur} {word}".strip()
        if draw.textlength(trial) <= width:
            cur = trial
            continue
        out.append(cur)
        cur = word
    out.append(cur)
    if len(out) > lines:
        last = out[lines - 1]
        while last and draw.textlength(last + "...") > width:
            last = last[:-1]
        out = out[: lines - 1] + [last + "..."]
    return [line for line in out if line] or [""]
