"""lorakit beside SimpleTuner (bghira) training the same LoRA on the same GPU, data and random-weight folder, each side
timed as the wall clock shows it (tools/race.py's `measure`): command -> first step, -> the final LoRA file (the
whole job), steady s/step (median and p90 of the wall time between consecutive steps after the second), GPU peak
(NVML) and the private host peak of the process tree.

    python tools/race.py synth --family flux --models M && python tools/race.py data --out D --count 16
    python tools/peer_simpletuner.py race --st-path SITE --family flux --models M --data D --work W \
        --setting datacenter|24gb --steps 300 [--only st lorakit]

SITE is a folder holding SimpleTuner (`pip install --target SITE simpletuner==4.10.1`, the version measured) and
the packages it needs beyond the environment's; it goes first on SimpleTuner's PYTHONPATH only (its transformers
may differ from lorakit's). `--st-python` may instead name a virtual environment's Python that has it installed. For
a machine without network, what to carry is what a `--tiny` run imports beyond that machine's packages
(benchmarks-history.md, 2026-11-29, says how the race's archive was made). SimpleTuner is not part of lorakit;
docs/benchmarks.md names the version measured. SimpleTuner runs as its `simpletuner train` runs it — `accelerate
launch --mixed_precision=bf16 --num_processes=1 --num_machines=1 --dynamo_backend=no train.py` with
`CONFIG_BACKEND=json` — on ITS example config for the case,
`simpletuner/examples/<flux|qwen_image>.peft-lora/config.json` read from the installed package (made, its README
says, for a 24 GB card), with only these changes (each said in the report's `changed`):
  - the model folder, the output folder, the steps, `model_flavour` naming the published model the folder stands
    for (FLUX.1-dev, Qwen-Image v1.0);
  - the dataset: the race's PNGs with their caption files (`caption_strategy: textfile`), 1024² pixel area in
    aspect buckets (no crop), text embeddings and latents cached before the first step as its example does —
    both trainers see the same 1024-class buckets (its example: a hub dataset cropped square at 512 or 1024);
  - the LoRA on lorakit's default modules (FLUX: its default `flux_lora_target: all` is the same 266 attention
    projections; Qwen-Image: `peft_lora_target_modules`, its default being 4 of the 8), rank and alpha 16;
  - `checkpoint_step_interval` = steps: one save at the end, as lorakit writes (its examples save every 10 or 250);
  - `validation_steps` (and `validation_step_interval`) = steps: validation images at the end (its own prompt,
    resolution and inference steps);
  - what the example would fetch at start from a hub the race's machine cannot reach (4.10.1's Qwen-Image example,
    made for Qwen-Image-2.1: CREPA's DINOv2 encoder through torch.hub, the assistant LoRA, a prompt library file of
    its repository checkout): off, each named in `changed`;
  - `datacenter`: `base_model_precision: no_change` (its FLUX quickstart: "a bit more than 30G VRAM when not
    quantising the base model"); `24gb`: FLUX's example's int8-quanto base as documented, Qwen-Image's quickstart's
    lowest-VRAM settings (int2-quanto, "required for 24GB cards", quantised on the CPU, `offload_during_startup`,
    expandable segments), both processes held to 24 GiB (`lorakit.hardware.gpu.apply_cap`: the CUDA context inside
    the cap, as on the card);
  - `--st-dynamo-wrapper python` where its compiled example's default C++ wrapper fails on the machine's torch,
    `--st-no-compile` where its compile fails altogether (each option's help quotes the error).
lorakit runs `lorakit train` as a user does (race.py's lorakit side: own YAML, the profile's defaults, rtx4090 under
the 24 GiB cap). SimpleTuner's steps are timed where it counts them (`IterationTracker.record_step`, once per
optimizer step, through the launcher below); lorakit's from metrics.jsonl. `--tiny` runs both on the tiny layout
on a CPU (the tool's test; `pin_memory` is made a no-op there, as a CPU has no page-locked memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # noqa: E402 - tools/ is not a package

EXAMPLES = {"flux": ("flux.peft-lora", "dev"), "qwen-image": ("qwen_image.peft-lora", "v1.0")}
LORA_FILE = "pytorch_lora_weights.safetensors"
QUANT_24GB = {  # QWEN_IMAGE.md's "Lowest VRAM config (24GB minimum)": int2-quanto ("required for 24GB cards"),
    # `--quantize_via=cpu` ("to avoid OOM during startup": its default quantises on the GPU, the bf16 transformer
    # first), `offload_during_startup` (for OOM while caching); the 4.10.1 example (made for Qwen-Image-2.1) leaves
    # the base unquantised. FLUX: the example's own int8-quanto, quantised on the CPU as it says.
    "qwen-image": {"base_model_precision": "int2-quanto", "quantize_via": "cpu", "offload_during_startup": True}}
ALLOC_24GB = {"qwen-image": "expandable_segments:True"}  # the same tips' PYTORCH_CUDA_ALLOC_CONF
OFFLINE = {  # SimpleTuner 4.10.1's Qwen-Image example (made for Qwen-Image-2.1) fetches these at start
    "crepa_enabled": "its CREPA regulariser loads DINOv2 through torch.hub, a download",
    "assistant_lora_path": "a hub download, made for Qwen-Image-2.1",
    "user_prompt_library": "a file of its repository checkout, not of the installed package",
}


# ---- in the measured process (started by accelerate launch) ----

def launch(a) -> None:
    """SimpleTuner's train.py as __main__, with the cap applied and the time of each optimizer step written to
    `--stats` as it goes and at exit."""
    import runpy

    os.chdir(a.cwd)  # SimpleTuner writes its debug.log where it runs
    import torch

    log = race.StepLog(a.stats, a.cap)
    if a.inductor_first:  # see race --st-inductor-first
        import torch._inductor.compile_fx  # noqa: F401
        log.rec["inductor_first"] = True
    if not torch.cuda.is_available():  # the CPU test: SimpleTuner pins each latent it loads
        torch.Tensor.pin_memory = lambda self, *args, **kw: self
        log.rec["pin_memory"] = "no-op (no GPU)"
    import simpletuner
    from simpletuner.helpers.training.iteration_tracker import IterationTracker

    record = IterationTracker.record_step

    def timed(self, global_step):
        log.step()
        return record(self, global_step)
    IterationTracker.record_step = timed
    train = Path(simpletuner.__file__).parent / "train.py"
    sys.argv = [str(train)]
    runpy.run_path(str(train), run_name="__main__")


# ---- the driver ----

def st_config(a, out: Path, example: Path) -> tuple[Path, list[str]]:
    """SimpleTuner's example config for the family with the race's changes (module docstring), and its data backend
    file; returns the config's path without `.json` (as its CONFIG_PATH takes it) and the list of changes."""
    from lorakit.models.base import family_adapter

    name, flavour = EXAMPLES[a.family]
    cfg = json.loads((example / name / "config.json").read_text())
    changed = ["model, dataset and output folders", f"max_train_steps {cfg.get('max_train_steps')} -> {a.steps}",
               f"model_flavour {cfg.get('model_flavour')} -> {flavour}"]
    res = 64 if a.tiny else 1024
    backend = [{"id": "race", "type": "local", "instance_data_dir": str(a.data), "crop": False,
                "resolution": res, "resolution_type": "pixel_area", "minimum_image_size": res // 2,
                "maximum_image_size": res * 2, "target_downsample_size": res, "caption_strategy": "textfile",
                "metadata_backend": "discovery", "repeats": 0, "cache_dir_vae": str(out / "cache" / "vae")},
               {"id": "text-embeds", "dataset_type": "text_embeds", "default": True, "type": "local",
                "cache_dir": str(out / "cache" / "text")}]
    (out / "multidatabackend.json").write_text(json.dumps(backend, indent=1))
    changed.append(f"dataset: the race's PNGs, {res}² pixel area, aspect buckets, textfile captions")
    cfg.update(pretrained_model_name_or_path=str(Path(a.models) / a.family), model_flavour=flavour,
               data_backend_config=str(out / "multidatabackend.json"), output_dir=str(out / "output"),
               max_train_steps=a.steps, num_train_epochs=0)
    modules = list(family_adapter(a.family).preset_modules("attention"))
    if a.family == "flux":
        cfg.setdefault("flux_lora_target", "all")
        changed.append("LoRA modules: its flux_lora_target 'all' (the same 266 attention projections)")
    else:
        cfg["peft_lora_target_modules"] = modules
        changed.append("LoRA modules: lorakit's attention preset (" + ", ".join(modules) + ")")
    if (cfg.get("lora_rank"), cfg.get("lora_alpha")) != (16, 16):
        changed.append(f"rank/alpha {cfg.get('lora_rank')}/{cfg.get('lora_alpha')} -> 16/16")
    cfg.update(lora_rank=16, lora_alpha=16)
    for key, why in OFFLINE.items():  # what the example fetches from a hub the race's machine cannot reach
        if cfg.get(key):
            changed.append(f"{key} {cfg[key]!r} off: {why}")
            cfg[key] = False if key.endswith("_enabled") else None
    if cfg.get("assistant_lora_path") is None and "assistant_lora_path" in cfg:
        cfg["disable_assistant_lora"] = True
    every = {k: cfg.get(k) for k in ("checkpoint_step_interval", "validation_steps",
                                     *(["validation_step_interval"] if "validation_step_interval" in cfg else []))}
    changed.append(", ".join(f"{k} {v} -> {a.steps}" for k, v in every.items()) + " (one save, validation at the end)")
    cfg.update({k: a.steps for k in every}, resume_from_checkpoint=None)
    want = ({"base_model_precision": "no_change"} if a.setting == "datacenter"
            else QUANT_24GB.get(a.family, {"base_model_precision": cfg.get("base_model_precision")}))
    for key, value in want.items():
        if cfg.get(key) != value:
            why = "80 GB card" if a.setting == "datacenter" else "its quickstart's 24 GB setting"
            changed.append(f"{key} {cfg.get(key)} -> {value} ({why})")
            cfg[key] = value
    if a.st_no_compile and cfg.get("dynamo_backend", "no") != "no":
        changed.append(f"dynamo_backend {cfg['dynamo_backend']} -> no (--st-no-compile)")
        cfg["dynamo_backend"] = "no"
    if a.st_dynamo_wrapper and cfg.get("dynamo_backend", "no") != "no":
        changed.append(f"dynamo_wrapper {cfg.get('dynamo_wrapper', 'cpp (its default)')} -> {a.st_dynamo_wrapper} "
                       "(--st-dynamo-wrapper)")
        cfg["dynamo_wrapper"] = a.st_dynamo_wrapper
    if a.tiny:
        cfg.update(validation_resolution="64x64", validation_num_inference_steps=2, base_model_precision="no_change")
    path = out / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path.with_suffix(""), changed


def st_example_dir(a) -> Path:
    """The installed SimpleTuner's examples folder, found on its own path (not imported here: lorakit's
    transformers and SimpleTuner's differ)."""
    code = "import simpletuner, pathlib; print(pathlib.Path(simpletuner.__file__).parent / 'examples')"
    got = subprocess.run([a.st_python, "-c", code], env={**os.environ, **st_env(a)}, capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"SimpleTuner is not importable with --st-path {a.st_path}: {got.stderr.strip()[-500:]}")
    return Path(got.stdout.strip())


def st_env(a) -> dict:
    path = [*(a.st_path or []), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


def st_run(a, work: Path) -> dict:
    out = work / f"st-{a.setting}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    example = st_example_dir(a)
    cfg, changed = st_config(a, out, example)
    stats = work / f"st-{a.setting}.stats.json"
    stats.unlink(missing_ok=True)
    cmd = [a.st_python, "-m", "accelerate.commands.launch", "--mixed_precision=bf16", "--num_processes=1",
           "--num_machines=1", "--dynamo_backend=no", str(Path(__file__).resolve()), "launch", "--stats", str(stats),
           "--cwd", str(out), *(["--cap", str(a.cap)] if a.cap else []),
           *(["--inductor-first"] if a.st_inductor_first else [])]
    if a.st_inductor_first:
        changed.append("torch._inductor imported before SimpleTuner starts (--st-inductor-first)")
    env = {**st_env(a), "CONFIG_BACKEND": "json", "CONFIG_PATH": str(cfg)}
    if a.setting == "24gb" and a.family in ALLOC_24GB:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_24GB[a.family]
        changed.append(f"PYTORCH_CUDA_ALLOC_CONF={ALLOC_24GB[a.family]} (its quickstart's 24 GB tips)")
    return race.peer_record(a, cmd, env, work / f"st-{a.setting}.log", stats, out / "output" / LORA_FILE,
                            "SimpleTuner", changed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    race.add_launch_args(la)
    la.add_argument("--cwd", default=".")
    la.add_argument("--inductor-first", action="store_true")
    r = sub.add_parser("race")
    r.add_argument("--st-path", action="append", help="a folder holding SimpleTuner and its own packages, put first "
                   "on its PYTHONPATH only: lorakit keeps its own")
    r.add_argument("--st-python", default=sys.executable, help="the Python that runs SimpleTuner (3.12 or 3.13)")
    r.add_argument("--st-inductor-first", action="store_true", help="import torch._inductor in SimpleTuner's process "
                   "before SimpleTuner loads (its 24 GB FLUX example on torch 2.11.0 + optimum-quanto 0.2.7 on an "
                   "H200 failed its first step importing it later: \"TypeError: 'CustomDecompTable' object is not a "
                   "mapping\", torch/_inductor/decomposition.py, from torch.compiler.cudagraph_mark_step_begin)")
    r.add_argument("--st-dynamo-wrapper", choices=["python", "cpp"], help="its `dynamo_wrapper` for an example "
                   "that compiles (Qwen-Image's regional blocks): its default, cpp, failed on torch 2.11.0 (H200) "
                   "compiling the generated wrapper (torch/csrc/stable/stableivalue_conversions.h: no matching "
                   "'from(cached_torch_device_type_cuda, 0)'); python is its other choice")
    r.add_argument("--st-no-compile", action="store_true", help="its `dynamo_backend: no` for an example that "
                   "compiles: its Qwen-Image regional compile over int2-quanto Linears failed on torch 2.11.0 + "
                   "optimum-quanto 0.2.7 (H200): 'InternalTorchDynamoError: RuntimeError: Attempted to set the "
                   "storage of a tensor on device \"cuda:0\" to a storage on different device \"meta\"', from "
                   "quanto's qlinear.py forward; its quickstart's 24 GB config sets no compile")
    race.add_race_args(r, sorted(EXAMPLES), "st")
    a = p.parse_args()
    launch(a) if a.cmd == "launch" else race.race_peer(a, "SimpleTuner", "st", st_run)


if __name__ == "__main__":
    main()
