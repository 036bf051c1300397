"""The user's whole path at real size, as separate commands, one JSON per stage (docs/benchmarks.md, issue 17).

    python tools/e2e.py STAGES --family flux --profile datacenter --models /tmp/models --work /tmp/e2e [--cap 24]

Stages (in the order given): synth (the full-size hub-layout model folder, random weights, written through
lorakit.io), doctor (fresh, cached, --quick; first-line latency), data (20 drawn 1024² images, + controls for
edit families), cache (`lorakit cache`), train (`lorakit train`, 100 steps, the profile's defaults; page cache
dropped first when root can), warm (a second run: warm page and compile caches, 5 steps, time to first step),
infer (`lorakit infer`, 4 images x 28 steps, beside the stock pipeline + load_lora_weights in the same
process order), reproduce (the stock transformer + load_lora_weights on the GPU against lorakit's trained
transformer, one cached batch, bf16 tolerance), drop (delete the model folder). Every stage writes
WORK/<family>-<profile>/<stage>.json; failures are recorded and later stages still run where they can.
`--tiny` runs the same path on the tiny layout on a CPU (the script's own test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

PROMPTS = ["a red circle in the center on a blue background", "a yellow square at the top left on a black background",
           "a green triangle at the bottom right on a white background", "a purple star in the middle on an orange "
                                                                         "background"]


DEADLINE = [float("inf")]  # --limit: commands are stopped before it, their output so far kept


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def sh(args: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    """Run a lorakit command; wall time, exit code (124: stopped at the plan's time limit), the JSON it printed
    (when it did), the stderr tail (a stopped command's too: where it was)."""
    t0 = time.time()
    timeout = max(1.0, min(timeout, DEADLINE[0] - t0))
    try:
        p = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = 124, _text(e.stdout), _text(e.stderr)
    out = {"cmd": " ".join(args), "rc": rc, "wall_s": round(time.time() - t0, 2), "started": t0}
    try:
        out["json"] = json.loads(stdout)
    except ValueError:
        out["stdout_tail"] = stdout[-3000:]
    out["stderr_tail"] = stderr[-3000:]
    return out


def lorakit(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorakit", *args]


class Run:
    def __init__(self, a):
        self.a = a
        self.fam, self.profile = a.family, a.profile
        self.name = f"{a.family}-{a.profile}" + (f"-cap{a.cap:g}" if a.cap else "")
        self.dir = Path(a.work) / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = Path(a.models) / a.family
        self.data = Path(a.work) / f"data-{a.family}"
        self.env = {"LORAKIT_PROGRESS": "1", **({"LORAKIT_MEMORY_CAP_GIB": str(a.cap)} if a.cap else {})}
        self.res = 64 if a.tiny else 1024

    def save(self, stage: str, rec: dict) -> None:
        (self.dir / f"{stage}.json").write_text(json.dumps(rec, indent=2, default=str))
        quiet = ("json", "stderr_tail", "stdout_tail", "traceback")  # (the log's filter drops progress-bar lines)
        brief = {k: ({i: w for i, w in v.items() if i not in quiet} if isinstance(v, dict) else v)
                 for k, v in rec.items() if k not in quiet}
        print(f"== {self.name} {stage}: {json.dumps(brief, default=str)[:1500]}", flush=True)

    def config(self, out: Path, steps: int, **extra) -> Path:
        import yaml

        from lorakit.models.base import family_adapter

        data = {"dirs": [str(self.data)], "resolution": self.res,
                "cache_dir": str(self.dir / "run" / "cache")}  # every run of this family and profile: one cache
        if self.a.tiny:
            data.update(bucket_min_side=32, bucket_max_side=128)
            if family_adapter(self.fam).max_controls:
                data["control_resolution"] = 64
        cfg = {"profile": self.profile, "model": {"family": self.fam, "path": str(self.model)}, "data": data,
               "schedule": {"steps": steps}, "output": {"dir": str(out)}, **extra}
        for item in self.a.set:  # --set a.b=value (YAML value), as `lorakit train --set` takes them
            key, _, value = item.partition("=")
            *parents, leaf = key.split(".")
            node = cfg
            for k in parents:
                node = node.setdefault(k, {})
            node[leaf] = yaml.safe_load(value)
        path = out.with_suffix(".yaml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg))
        return path

    # ---- stages ----

    def synth(self) -> dict:
        from lorakit.bench.hub import write_model

        if (self.model / "lorakit_synthetic.json").is_file():
            return {"reused": str(self.model), **json.loads((self.model / "lorakit_synthetic.json").read_text())}
        self.model.parent.mkdir(parents=True, exist_ok=True)
        if self.a.like:  # another family of the same weights (Qwen-Image beside Qwen-Image-Edit-2509)
            return _alias(self.fam, self.model, Path(self.a.models) / self.a.like)
        rep = write_model(self.fam, self.model, device="cpu" if self.a.tiny else "cuda",
                          scale="tiny" if self.a.tiny else "full")
        rep["disk_free_gib"] = round(shutil.disk_usage(self.model).free / 2**30, 1)
        return rep

    def doctor(self) -> dict:
        """A first doctor as on a fresh machine (its cached measurements removed), then cached, then --quick.
        The cache is the one later commands read (train takes its attention choice from it)."""
        from lorakit.paths import cache_root

        for sub in ("attention", "libs"):
            shutil.rmtree(cache_root() / sub, ignore_errors=True)
        env = {"COLUMNS": "160"}
        out = {}
        for label, args in (("fresh", []), ("cached", []), ("quick", ["--quick"])):
            t0 = time.time()
            p = subprocess.Popen(lorakit("doctor", "--disk", str(self.dir), *args), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
            first, lines = None, []
            for line in p.stdout:
                if first is None:
                    first = round(time.time() - t0, 2)
                lines.append((round(time.time() - t0, 2), line.rstrip()))
            p.wait()
            out[label] = {"rc": p.returncode, "wall_s": round(time.time() - t0, 2), "first_line_s": first,
                          "lines": lines}
        j = sh(lorakit("doctor", "--json", "--disk", str(self.dir)), env=env)
        out["json"] = j.get("json")
        return out

    def data_stage(self) -> dict:
        from lorakit.data.demo import demo_layout_for, make_demo_dataset

        t0 = time.time()
        layout = demo_layout_for(self.fam)
        make_demo_dataset(self.data, layout, count=self.a.images, size=self.res, frames=17)
        return {"layout": layout, "items": self.a.images, "size": self.res, "seconds": round(time.time() - t0, 2)}

    def cache(self) -> dict:
        """`lorakit cache`, then (text-to-image families) the stock pipeline's own encoders over the same items,
        both from a warm page cache."""
        cfg = self.config(self.dir / "run", self.a.steps)
        if self.a.no_stock or self.fam not in ("flux", "qwen-image"):  # alone: as the user's command finds it
            return sh(lorakit("cache", str(cfg), "--json"), env=self.env)
        warmed = _read_all(self.model)
        ours = sh(lorakit("cache", str(cfg), "--json"), env=self.env)
        stock = sh([sys.executable, __file__, "stock-cache", "--family", self.fam, "--models", self.a.models,
                    "--work", self.a.work, "--profile", self.profile, *(["--tiny"] if self.a.tiny else [])],
                   env=self.env)
        return {**ours, "stock": stock, "page_cache_warmed_gib": warmed}

    def train(self) -> dict:
        dropped = False if self.a.warm_page_cache else _drop_page_cache()
        out = self.dir / ("run-" + self.a.tag if self.a.tag else "run")
        cfg = self.config(out, self.a.steps)
        r = sh(lorakit("train", str(cfg), "--json"), env=self.env)
        r["page_cache_dropped"] = dropped
        return _with_steps(r, out / "metrics.jsonl")

    def warm(self) -> dict:
        out = self.dir / "warm"
        shutil.rmtree(out, ignore_errors=True)
        cfg = self.config(out, 5, sampling={"enabled": False})
        return _with_steps(sh(lorakit("train", str(cfg), "--json"), env=self.env), out / "metrics.jsonl")

    def infer(self) -> dict:
        lora = Path(self.a.lora) if self.a.lora else self.dir / "run" / "lora.safetensors"
        ctrl = []
        folders = sorted(self.data.iterdir()) if self.data.is_dir() else []  # none when the LoRA is made, not trained
        for folder in [p for p in folders if p.is_dir() and p.name.startswith("control")]:
            ctrl += ["--image", str(sorted(folder.glob("*.png"))[0])]
        steps = "2" if self.a.tiny else "28"
        args = ["infer", str(self.model), "--lora", str(lora), "--steps", steps, "--offload", self.a.offload, "--width", str(self.res),
                "--height", str(self.res), "-o", str(self.dir / "infer"), "--json", *ctrl]
        for p in PROMPTS[:self.a.prompts]:
            args += ["-p", p]
        warmed = _read_all(self.model)  # both sides start from a warm page cache (neither pays the other's reads)
        ours = sh(lorakit(*args), env=self.env)
        if self.a.no_stock:
            return {"lorakit": ours, "page_cache_warmed_gib": warmed}
        stock = sh([sys.executable, __file__, "stock-infer", "--family", self.fam, "--models", self.a.models,
                    "--work", self.a.work, "--profile", self.profile, *(["--tiny"] if self.a.tiny else []),
                    "--lora", str(lora), *ctrl], env=self.env)
        return {"lorakit": ours, "stock": stock, "page_cache_warmed_gib": warmed}

    def stage_name(self, stage: str) -> str:
        if stage == "train" and self.a.tag:
            return f"train-{self.a.tag}"
        return f"{stage}-{self.a.offload}" if stage == "infer" and self.a.offload != "auto" else stage

    def lora(self) -> dict:
        """A random rank-16 LoRA on the default targets, in the file layout `lorakit train` writes (for an
        infer measurement without training first)."""
        import torch
        from accelerate import init_empty_weights

        from lorakit.config.schema import LoraConfig
        from lorakit.io import save
        from lorakit.io.modules import _class_of
        from lorakit.models.base import family_adapter
        from lorakit.train.lora import target_modules

        folder = self.model / "transformer"
        cls = _class_of(folder)[1]
        with init_empty_weights():
            tr = cls.from_config(cls.load_config(folder))
        fa = family_adapter(self.fam)
        g = torch.Generator().manual_seed(0)
        mods = dict(tr.named_modules())
        out = {}
        for m in target_modules(tr, fa, LoraConfig().targets):
            o, i = mods[m].weight.shape
            out[f"transformer.{m}.lora_A.weight"] = torch.randn(16, i, generator=g) / i ** 0.5
            out[f"transformer.{m}.lora_B.weight"] = torch.randn(o, 16, generator=g) * 1e-3
        path = self.dir / "run" / "lora.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save(out, path)
        return {"path": str(path), "modules": len(out) // 2}

    def reproduce(self) -> dict:
        return sh([sys.executable, __file__, "stock-reproduce", "--family", self.fam, "--models", self.a.models,
                   "--work", self.a.work, "--profile", self.profile, *(["--tiny"] if self.a.tiny else [])],
                  env=self.env)

    def drop(self) -> dict:
        shutil.rmtree(self.model, ignore_errors=True)
        return {"removed": str(self.model), "disk_free_gib": round(shutil.disk_usage(self.a.models).free / 2**30, 1)}


def _alias(family: str, out: Path, like: Path) -> dict:
    """The family's own model_index, tokenizers and scheduler, with the weight components of `like` linked."""
    import torch

    from lorakit.models.base import family_adapter

    pipe = family_adapter(family).build_tiny(0)
    pipe.save_pretrained(out, safe_serialization=True)
    linked = []
    for name, part in pipe.components.items():
        if isinstance(part, torch.nn.Module):
            shutil.rmtree(out / name)
            (out / name).symlink_to((like / name).resolve(), target_is_directory=True)
            linked.append(name)
    (out / "lorakit_synthetic.json").write_text(json.dumps({"family": family, "linked_from": str(like),
                                                            "components": linked}))
    return {"linked_from": str(like), "components": linked}


def _read_all(folder: Path) -> float:
    """Read every weight file of a model folder once (into the page cache); GiB read."""
    n = 0
    for f in sorted(folder.rglob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return round(n / 2**30, 1)


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _with_steps(r: dict, metrics: Path) -> dict:
    """Time from the command's start to the first step's end, and the steady s/step (median after step 10)."""
    if metrics.is_file():
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if recs and "time" in recs[0]:
            r["command_to_first_step_s"] = round(recs[0]["time"] - r["started"], 2)
        steady = sorted(x["s_per_step"] for x in recs[10:]) or sorted(x["s_per_step"] for x in recs)
        if steady:
            r["median_s_per_step"] = steady[len(steady) // 2]
        r["losses_first_last"] = [recs[0]["loss"], recs[-1]["loss"]] if recs else None
        r["val_losses"] = [[x["step"], x["val_loss"]] for x in recs if "val_loss" in x]
    return r


# ---- the stock pipeline, in its own process (as a user runs it) ----

def stock_infer(a) -> None:
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    run = Run(a)
    dev = "cpu" if a.tiny else "cuda"
    from lorakit.hardware.gpu import apply_cap

    apply_cap(dev)
    t0 = time.perf_counter()
    dt = torch.float32 if a.tiny else torch.bfloat16
    plan = None
    pipe = DiffusionPipeline.from_pretrained(run.model, torch_dtype=dt)
    pipe.load_lora_weights(a.lora)
    if dev == "cuda":  # the placement lorakit infer chose (on a small card: diffusers' own offloading)
        from lorakit import placement

        names = [k for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)]
        plan = placement.choose(placement.component_gib(run.model, names, 2), placement.budget_gib(dev))
        # (no fp8 here: the stock pipeline keeps its bf16 weights, streamed where they do not fit)
        if plan.mode == "none":
            pipe.to(dev)
        elif plan.mode == "model":  # diffusers' own (lorakit's Swap is what is measured on the other side)
            pipe.enable_model_cpu_offload(device=dev)
        else:
            placement.apply(pipe, plan, dev)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - t0
    from lorakit.models.base import family_adapter

    fa = family_adapter(a.family)
    kw = fa.call_kwargs(run.res, run.res)
    if a.image:
        imgs = [Image.open(p).convert("RGB") for p in a.image]
        kw["image"] = imgs[0] if fa.max_controls == 1 else imgs
    times = []
    for k, prompt in enumerate(PROMPTS):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        pipe(prompt=prompt, num_inference_steps=2 if a.tiny else 28, generator=torch.Generator().manual_seed(k),
             **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None
    print(json.dumps({"load_s": round(load_s, 2), "seconds_per_image": round(sorted(times)[len(times) // 2], 3),
                      "times": [round(t, 3) for t in times], "peak_gpu_gib": peak,
                      "offload": plan.mode if plan else None}))


def stock_cache(a) -> None:
    """What a diffusers user precomputes before training (as diffusers' train_dreambooth_lora_* scripts do): the
    pipeline without its transformer on the GPU, `encode_prompt` and `vae.encode` per item, one at a time."""
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from lorakit.hardware.gpu import apply_cap

    run = Run(a)
    dev = "cpu" if a.tiny else "cuda"
    apply_cap(dev)
    dt = torch.float32 if a.tiny else torch.bfloat16
    t0 = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(run.model, transformer=None, torch_dtype=dt).to(dev)
    load_s = time.perf_counter() - t0
    items = sorted(p for p in run.data.iterdir() if p.suffix in (".png", ".jpg", ".jpeg", ".webp"))
    with torch.no_grad():
        if dev == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for path in items:
            caption = path.with_suffix(".txt").read_text(encoding="utf-8").strip()
            if a.family == "flux":
                pipe.encode_prompt(prompt=caption, prompt_2=None, device=dev)
            else:
                pipe.encode_prompt(prompt=caption, device=dev)
            x = pipe.image_processor.preprocess(Image.open(path).convert("RGB"), height=run.res, width=run.res)
            x = x.to(dev, dt)
            pipe.vae.encode(x.unsqueeze(2) if a.family == "qwen-image" else x).latent_dist.sample()
        if dev == "cuda":
            torch.cuda.synchronize()
        enc = time.perf_counter() - t1
    print(json.dumps({"load_s": round(load_s, 2), "items": len(items), "encode_s": round(enc, 2),
                      "items_per_s": round(len(items) / enc, 3),
                      "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None}))


def stock_reproduce(a) -> None:
    """lorakit's trained transformer (the final checkpoint, resumed as `--resume` does) against the stock
    transformer with load_lora_weights, one cached batch, same noise and sigma, on the GPU in bf16."""
    import torch

    from lorakit.cache.builder import cache_dir_for
    from lorakit.cache.store import Store
    from lorakit.config import assemble
    from lorakit.io.modules import load_component
    from lorakit.models.base import load_adapter
    from lorakit.train.data import CachedData
    from lorakit.train.trainer import Trainer

    run = Run(a)
    dev = "cpu" if a.tiny else "cuda"
    dt = torch.float32 if a.tiny else torch.bfloat16
    cfg, _ = assemble(run.dir / "run.yaml", ["memory.compile=false"], None)
    ad = load_adapter(a.family, run.model, device=dev, dtype=dt)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    b = data.load([data.items[0]["key"]])
    g = torch.Generator().manual_seed(0)
    xt = torch.randn(b.latents.shape, generator=g).to(dev, dt)
    s = torch.tensor([0.6], device=dev)
    text = {k: (v.to(dev, dt) if v.is_floating_point() else v.to(dev)) for k, v in b.text.items()}
    controls = [c.to(dev, dt) for c in b.controls]
    tr = Trainer(cfg, ad, load_component(run.model / "transformer", dev, dt), data, run.dir / "x", dev, dt)
    tr.resume(run.dir / "run" / "checkpoints" / "final")
    tr.transformer.eval()
    with torch.no_grad():
        ours = ad.predict(tr.transformer, xt, s, text, controls=controls).float().cpu()
    del tr
    if dev == "cuda":
        torch.cuda.empty_cache()
    pipe = ad.pipeline_class().from_pretrained(run.model, torch_dtype=dt, **{n: None for n in ad.text_parts},
                                               vae=None)
    pipe.load_lora_weights(run.dir / "run" / "lora.safetensors")
    pipe.transformer.to(dev)
    with torch.no_grad():
        stock = ad.predict(pipe.transformer, xt, s, text, controls=controls).float().cpu()
        pipe.unload_lora_weights()
        base = ad.predict(pipe.transformer, xt, s, text, controls=controls).float().cpu()
    diff = (ours - stock).abs()
    moved = (ours - base).abs()
    rel = float(diff.norm() / stock.norm())
    print(json.dumps({"max_abs_diff": float(diff.max()), "rel_l2_diff": rel, "lora_effect_rel_l2":
                      float(moved.norm() / base.norm()), "within_bf16_tolerance": rel < 2e-2,
                      "shape": list(ours.shape)}))


STAGES = ("synth", "doctor", "data", "cache", "train", "lora", "warm", "infer", "reproduce", "drop")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="+", choices=(*STAGES, "stock-infer", "stock-reproduce", "stock-cache"))
    p.add_argument("--family", required=True)
    p.add_argument("--profile", default="datacenter")
    p.add_argument("--models", default="/tmp/models")
    p.add_argument("--work", default="/tmp/e2e")
    p.add_argument("--cap", type=float, default=None, help="LORAKIT_MEMORY_CAP_GIB for every command")
    p.add_argument("--images", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tiny", action="store_true", help="the tiny layout on a CPU (this script's test)")
    p.add_argument("--like", help="synth: link the weights of this already written family (same architecture)")
    p.add_argument("--lora", help="infer: this LoRA instead of the run's")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="infer: images made (one per prompt)")
    p.add_argument("--offload", default="auto", help="infer: lorakit infer --offload")
    p.add_argument("--no-stock", action="store_true", help="cache, infer: lorakit only")
    p.add_argument("--image", action="append", default=[])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for every stage's run.yaml (e.g. memory.compute=fp8)")
    p.add_argument("--tag", help="train: run in run-TAG beside run (the same cache), train-TAG.json")
    p.add_argument("--warm-page-cache", action="store_true", help="train: keep the page cache (the cold figure "
                   "drops it first)")
    p.add_argument("--limit", type=float, default=None, help="seconds: commands still running then are stopped "
                   "(their output so far recorded) so that every stage's JSON is written")
    a = p.parse_args()
    if a.limit:
        DEADLINE[0] = time.time() + a.limit
    if a.stages[0] == "stock-infer":
        return stock_infer(a)
    if a.stages[0] == "stock-reproduce":
        return stock_reproduce(a)
    if a.stages[0] == "stock-cache":
        return stock_cache(a)
    run = Run(a)
    for stage in a.stages:
        t0 = time.time()
        try:
            rec = (run.data_stage() if stage == "data" else getattr(run, stage)())
        except Exception as e:  # noqa: BLE001 - recorded; the next stages still run
            rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        rec["stage_s"] = round(time.time() - t0, 2)
        run.save(run.stage_name(stage), rec)


if __name__ == "__main__":
    main()
