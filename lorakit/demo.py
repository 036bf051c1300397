"""`lorakit demo`: the whole path on tiny offline models, on any laptop, without downloads.

tiny pipeline -> demo dataset -> doctor -> config resolution -> cache -> train (with sample grids during
training) -> sample grids from the stock diffusers pipeline without and with the LoRA (loaded by
`load_lora_weights`, the way users load it), so the demo also shows the file works outside lorakit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lorakit.cache.builder import build
from lorakit.config import dump_yaml
from lorakit.data.demo import demo_layout_for, make_demo_dataset
from lorakit.hardware import doctor as doc
from lorakit.hardware.probe import probe
from lorakit.hardware.profiles import choose
from lorakit.io import atomic_path
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info, family_names
from lorakit.models.tiny import tiny_pipeline
from lorakit.plan.resolve import resolve
from lorakit.quiet import quiet_libraries
from lorakit.train.loop import run
from lorakit.train.report import loss_summary
from lorakit.train.resume import clear_results

DEMO_PROMPTS = ("a red circle in the center on a blue background", "a yellow square at the top left on a black background")


@dataclass
class Stage:
    name: str
    seconds: float
    detail: str


@dataclass
class DemoResult:
    out_dir: Path
    family: str
    stages: list[Stage] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "family": self.family, "files": self.files,
                "stages": [s.__dict__ for s in self.stages]}


def demo_config(family: str, model_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    """The YAML config the demo writes (also a starting point for real runs: drop the tiny sizes, i.e.
    resolution, bucket sides, control_resolution and frames, to get the defaults)."""
    facts = family_adapter(family)
    tiny_sizes = {"resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128}
    if facts.max_controls:  # the pipelines encode controls at 1024²: minutes per step on a CPU
        tiny_sizes["control_resolution"] = 64
    if facts.layout == "video":  # the demo clips are 5 frames long
        tiny_sizes["frames"] = 5
    return {
        "model": {"family": family, "path": str(model_dir)},
        "data": {"dirs": [str(data_dir)], **tiny_sizes},
        "lora": {"rank": 16, "targets": "attention_mlp"},
        "optim": {"lr": 5e-3},
        "schedule": {"steps": 60, "warmup_steps": 5},
        "sampling": {"prompts": list(DEMO_PROMPTS), "steps": 4, "size": 64},
        "output": {"dir": str(out_dir / "run")},
    }


def sample_grid(model_dir: Path, family: str, prompts, size: int, steps: int, seed: int, control=None,
                lora: Path | None = None):
    """Images from the stock diffusers pipeline (with a LoRA loaded by load_lora_weights), side by side."""
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    adapter = family_adapter(family)
    pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:  # Wan 2.2 A14B: into the expert the demo trained (the low-noise one, transformer_2)
        second = adapter.trained_part(None) == "transformer_2"
        pipe.load_lora_weights(str(lora), **({"load_into_transformer_2": True} if second else {}))
    images = []
    for i, prompt in enumerate(prompts):
        kw = dict(prompt=prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed + i))
        kw.update(adapter.call_kwargs(size, size, frames=5))
        if adapter.first_frame:  # image-to-video: each clip starts from a plain first frame
            kw["image"] = Image.new("RGB", (size, size), (200, 30, 30))
        if control is not None:
            kw["image"] = control
        out = pipe(**kw)
        img = getattr(out, "images", None) or getattr(out, "image", None)
        if img is None:  # video: the middle frame stands for the clip
            frames = out.frames[0]
            img = [frames[len(frames) // 2]]
        first = img[0]
        if not isinstance(first, Image.Image):
            import numpy as np

            first = Image.fromarray((np.asarray(first) * 255).clip(0, 255).astype("uint8"))
        images.append(first.resize((size * 2, size * 2), Image.NEAREST))
    grid = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)), "white")
    x = 0
    for im in images:
        grid.paste(im, (x, 0))
        x += im.width
    return grid


def _write(path: Path, what) -> None:
    """Text or a PIL image, written atomically (a full disk is an error naming the file)."""
    with atomic_path(path) as tmp:
        if isinstance(what, str):
            tmp.write_text(what)
        else:
            what.save(tmp, format="PNG")


def _labelled(grid, *lines: str):
    """The grid under a white band that says what it is (a tiny random-weight model draws noise: by design)."""
    from PIL import Image, ImageDraw

    band = 14 * len(lines) + 8
    width = int(max(ImageDraw.Draw(grid).textlength(t) for t in lines)) + 8
    out = Image.new("RGB", (max(grid.width, width), grid.height + band), "white")
    out.paste(grid, (0, band))
    d = ImageDraw.Draw(out)
    for i, t in enumerate(lines):
        d.text((4, 4 + 14 * i), t, fill="black")
    return out


NOISE = "tiny random-weight model: noise is expected (the demo checks the path, not image quality)"


def run_demo(out_dir: Path, family: str | None = None, seed: int = 0, progress=None) -> DemoResult:
    """Run the demo into `out_dir` and return what it made."""
    quiet_libraries()
    family = family or family_names()[0]
    family_info(family)  # unknown names fail here, before any work
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    res = DemoResult(out_dir=out_dir, family=family)

    def stage(name: str, fn):
        if progress:
            progress(name)
        t0 = time.perf_counter()
        detail = fn()
        res.stages.append(Stage(name, round(time.perf_counter() - t0, 2), detail))

    model_dir: Path = out_dir / "model"

    def tiny_model():
        nonlocal model_dir
        model_dir = tiny_pipeline(family, seed=seed)
        res.files["model"] = str(model_dir)
        return f"tiny {family_info(family).pipeline_class} at {model_dir}"

    data_dir = out_dir / "data"
    layout = demo_layout_for(family)

    def data():
        make_demo_dataset(data_dir, layout=layout, count=4, size=64, seed=seed)
        res.files["data"] = str(data_dir)
        n = len(list(data_dir.rglob("*.txt")))
        return f"{n} captioned items ({layout} layout)"

    facts_holder = {}

    def doctor():
        facts = probe(out_dir)
        choice = choose("auto", facts)
        checks = doc.checks(facts, choice)
        facts_holder["choice"] = choice
        _write(out_dir / "doctor.json", json.dumps(
            {"summary": doc.summary(checks), "checks": doc.to_dicts(checks)}, indent=2))
        res.files["doctor"] = str(out_dir / "doctor.json")
        s = doc.summary(checks)
        said = [f"{c.name}: {c.detail}" for c in checks if c.status in (doc.WARN, doc.FAIL)]
        return (f"profile {choice.profile.name}; {s['fail']} failed, {s['warn']} warning(s)"
                + (f" — {'; '.join(said)}" if said else ""))

    def config():
        cfg_path = out_dir / "config.yaml"
        _write(cfg_path, yaml.safe_dump(demo_config(family, model_dir, data_dir, out_dir), sort_keys=False))
        r = resolve(cfg_path, [], "auto")
        _write(out_dir / "config.resolved.yaml", dump_yaml(r.cfg))
        res.files["config"] = str(cfg_path)
        res.files["resolved_config"] = str(out_dir / "config.resolved.yaml")
        return f"resolved with profile {r.profile['profile']}"

    def cache():
        r = resolve(out_dir / "config.yaml", [], "auto", train=False)
        s = build(r.cfg, r.device)
        res.files["cache"] = s.cache_dir
        return f"{s.items} items ({s.encoded} encoded, {s.reused} reused), {s.bytes / 2**10:.0f} KiB"

    def train():
        clear_results(out_dir / "run", "lora")  # the demo's own run folder: a second demo starts it over
        r = run(resolve(out_dir / "config.yaml", [], "auto"))
        res.files.update(lora=r["lora"], loss_curve=r["loss_curve"], metrics=r["metrics"])
        if r.get("samples"):
            res.files["training_samples"] = r["samples"]
        rows = [json.loads(x) for x in Path(r["metrics"]).read_text().splitlines() if x.strip()]
        said = loss_summary([x["loss"] for x in rows], rows[0]["step"])  # as the loss curve's title says it
        return f"{r['steps']} steps in {r['seconds']:.1f} s, {said}, LoRA {Path(r['lora']).name}"

    def sample():
        control = None
        if layout in ("edit", "edit-plus"):
            from PIL import Image

            stems = sorted(p.stem for p in (data_dir / "control").glob("*.png"))
            control = Image.open(data_dir / "control" / f"{stems[0]}.png").convert("RGB")
            if layout == "edit-plus":
                control = [control, Image.open(data_dir / "control_2" / f"{stems[0]}.png").convert("RGB")]
        grid = sample_grid(model_dir, family, DEMO_PROMPTS, 64, 4, seed, control)
        path = out_dir / "samples_base.png"
        _write(path, _labelled(grid, f"{family}: the stock diffusers pipeline, no LoRA", NOISE))
        res.files["samples_base"] = str(path)
        note = f"{len(DEMO_PROMPTS)} samples from the base -> {path.name} (random weights: noise, by design)"
        if "lora" in res.files:
            after = sample_grid(model_dir, family, DEMO_PROMPTS, 64, 4, seed, control, lora=Path(res.files["lora"]))
            _write(out_dir / "samples_lora.png", _labelled(
                after, f"{family}: the stock diffusers pipeline with the demo's LoRA (load_lora_weights)", NOISE))
            res.files["samples_lora"] = str(out_dir / "samples_lora.png")
            note += ", with the LoRA -> samples_lora.png"
        return note

    stage("build tiny pipeline", tiny_model)
    stage("demo dataset", data)
    stage("doctor", doctor)
    stage("config", config)
    stage("cache (text embeddings + latents)", cache)
    stage("train (LoRA)", train)
    stage("sample (stock diffusers pipeline)", sample)
    _write(out_dir / "demo.json", json.dumps(res.to_dict(), indent=2))
    return res
