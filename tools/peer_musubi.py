"""lorakit beside musubi-tuner (kohya-ss) training a Qwen-Image LoRA: same GPU, same command, same random-weight
checkpoint, same cached tensors (issue 19, target 6; results in docs/benchmarks.md "musubi-tuner, Qwen-Image LoRA").

    python tools/peer_musubi.py compare --musubi SRC --models M --work W --setting unconstrained|24gb [--steps 300]
        [--only lorakit musubi-24gb] [--limit SECONDS]

A side still running at --limit is stopped; its steps so far are kept (musubi's are written as they come).

Before it: `python tools/e2e.py synth data cache --family qwen-image --profile datacenter --models M --work W`
(the full-size diffusers folder and lorakit's cache of the 20 synthetic 1024² items). musubi-tuner is not part of
lorakit: SRC is a checkout of its `src/` folder and its runtime packages (toml, voluptuous, easydict, ftfy,
opencv-python-headless, av, accelerate) must be importable; docs/benchmarks.md names the commit measured.

What runs, one process at a time on the same GPU:
  export   lorakit's cached latents and text embeddings -> musubi's cache files, written by musubi's own cache
           writers (`save_latent_cache_qwen_image`, `save_text_encoder_output_cache_qwen_image`): the same tensors
  musubi   `qwen_image_train_network` with the options its Qwen-Image guide documents for the setting
           (unconstrained: --sdpa --gradient_checkpointing, then without checkpointing; 24gb: + --fp8_base
           --fp8_scaled --blocks_to_swap 16; each also with its --compile), rank 16 on its default modules,
           AdamW, N steps
  lorakit  `lorakit train`, the setting's profile (datacenter; rtx4090 under LORAKIT_MEMORY_CAP_GIB=24), rank 16
           on the same 14 Linear modules of every block as musubi (MUSUBI_MODULES), N steps
Each process goes through the same launcher (`launch`): under a 24 GiB cap both are held to 24 GiB, the CUDA
context inside it (`lorakit.hardware.gpu.apply_cap`); the time of each optimizer step is taken where the trainer
counts it (musubi: its "steps" progress bar's update; lorakit: metrics.jsonl), torch's peak memory at exit,
and the GPU's used memory polled every 0.5 s (NVML). s/step = the median (and p90) step interval after the first 20 steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lorakit.bench.poll import Peak
from lorakit.hardware.gpu import apply_cap
from lorakit.models.base import family_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # noqa: E402 - tools/ is not a package

MUSUBI_COMMON = ["--mixed_precision", "bf16", "--sdpa", "--timestep_sampling", "shift", "--weighting_scheme", "none",
                 "--discrete_flow_shift", "2.2", "--optimizer_type", "AdamW", "--learning_rate", "5e-5",
                 "--network_module", "networks.lora_qwen_image", "--network_dim", "16", "--seed", "42",
                 "--max_data_loader_n_workers", "2", "--persistent_data_loader_workers"]
# musubi's Qwen-Image LoRA: every Linear of each block; its exclusion pattern `.*(_mod_).*` is matched against
# names like `img_mod.1` and so excludes nothing (its log: 14 modules per block, 840 in all)
# = lorakit's attention_mlp preset for Qwen-Image plus the two modulation Linears
MUSUBI_MODULES = (*family_adapter("qwen-image").preset_modules("attention_mlp"), "img_mod.1", "txt_mod.1")
SETTINGS = {  # name -> [(label, musubi options)], lorakit (profile, cap GiB)
    "unconstrained": ([("musubi-documented", ["--gradient_checkpointing"]), ("musubi-no-checkpointing", []),
                       ("musubi-compiled", ["--gradient_checkpointing", "--compile"])],
                      ("datacenter", None)),
    "24gb": ([("musubi-24gb", ["--gradient_checkpointing", "--fp8_base", "--fp8_scaled", "--blocks_to_swap", "16"]),
              ("musubi-24gb-compiled", ["--gradient_checkpointing", "--fp8_base", "--fp8_scaled", "--blocks_to_swap",
                                        "16", "--compile"])],
             ("rtx4090", 24)),
}


# ---- in the measured process ----

def launch(a) -> None:
    """Run a module as __main__ with the cap applied and the step times and torch's peak recorded at exit."""
    import atexit
    import runpy

    import torch

    rec = {"steps": [], "module": a.module}
    # each step's time as it comes, line by line: a side stopped at the limit (no exit handler) keeps them
    ticks = open(a.stats + ".steps", "a", buffering=1)
    if a.cap and torch.cuda.is_available():  # held as lorakit holds its own runs: the CUDA context inside the cap
        apply_cap("cuda", a.cap)
        rec["cap_gib"] = a.cap
    try:  # musubi counts optimizer steps on a tqdm bar named "steps"
        from tqdm import std

        update = std.tqdm.update

        def timed(self, n=1):
            out = update(self, n)
            if getattr(self, "desc", "") == "steps":
                rec["steps"].append(time.time())
                ticks.write(f"{rec['steps'][-1]}\n")
            return out
        std.tqdm.update = timed
    except ImportError:
        pass

    def done():
        if torch.cuda.is_available():
            rec["torch_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            rec["torch_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        Path(a.stats).write_text(json.dumps(rec))
    atexit.register(done)
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)


# ---- the driver ----

@functools.cache
def _nvml_card():
    """NVML started once per process, and the measured card's handle."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByIndex(race.gpu_index())


def gpu_used_mib() -> int:
    """The measured card's used memory in MiB, through NVML in this process (nvidia-ml-py; a spawned nvidia-smi
    every 0.2 s took the host from the trainer being measured), else nvidia-smi; 0 where neither can say."""
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(_nvml_card()).used // 2**20)
    except Exception:  # noqa: BLE001 - no NVML here: ask nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(race.gpu_index())],
                             capture_output=True, text=True, timeout=5).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def median_step(times: list[float], skip: int = 20) -> dict:
    """Median and p90 of the step intervals after the first `skip` (with 20 items: the second epoch on, where a
    compiling trainer meets no new caption length)."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    steady = sorted(gaps[skip:] or gaps)
    if not steady:
        return {"steps_timed": len(times), "median_s_per_step": None, "steady_intervals": 0}
    return {"steps_timed": len(times), "median_s_per_step": round(steady[len(steady) // 2], 4),
            "p90_s_per_step": round(steady[min(len(steady) - 1, int(0.9 * len(steady)))], 4),
            "steady_intervals": len(steady)}


def measured(label: str, module_args: list[str], out: Path, cap: float | None, env: dict, limit: float) -> dict:
    stats = out / f"{label}.stats.json"
    ticks = Path(str(stats) + ".steps")
    stats.unlink(missing_ok=True)
    ticks.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "launch", "--stats", str(stats), *(["--cap", str(cap)] if cap else []),
           *module_args]
    t0 = time.time()
    with Peak(gpu_used_mib, 0.5) as poll, open(out / f"{label}.out", "w") as so, open(out / f"{label}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=so, stderr=log, env={**os.environ, **env},
                                timeout=max(10, limit)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    rec = {"label": label, "rc": rc, "started": t0, "wall_s": round(time.time() - t0, 1), "nvidia_smi_peak_gib":
           round(poll.peak / 1024, 2), "cmd": " ".join(module_args)}
    if stats.is_file():
        s = json.loads(stats.read_text())
        rec.update({k: v for k, v in s.items() if k != "steps"})
        rec["step_times"] = s["steps"]
    elif ticks.is_file():  # stopped at the limit (no exit of its own): the steps it made
        rec["step_times"] = [float(x) for x in ticks.read_text().split()]
    rec["log_tail"] = (out / f"{label}.log").read_text(errors="replace")[-2500:]
    try:
        rec["json"] = json.loads((out / f"{label}.out").read_text())
    except ValueError:
        rec["stdout_tail"] = (out / f"{label}.out").read_text(errors="replace")[-1500:]
    return rec


def export(cache: Path, out: Path, musubi: Path) -> dict:
    """lorakit's cache items -> musubi's Qwen-Image cache files (through musubi's own writers)."""
    sys.path.insert(0, str(musubi))
    from musubi_tuner.dataset.image_video_dataset import (
        ARCHITECTURE_QWEN_IMAGE,
        ItemInfo,
        save_latent_cache_qwen_image,
        save_text_encoder_output_cache_qwen_image,
    )

    from lorakit.io import load

    manifest = json.loads((cache / "manifest.json").read_text())
    if manifest["family"] != "qwen-image":
        raise SystemExit(f"{cache}: a {manifest['family']} cache; this comparison is Qwen-Image's")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = []
    for it in manifest["items"]:
        t = load(cache / "items" / f"{it['key']}.safetensors")
        lat, emb = t["latents"], t["prompt_embeds"]  # (16, h, w) normalised as musubi's VAE encode gives; (n, 3584)
        w, h = it["bucket"][0], it["bucket"][1]
        info = ItemInfo(Path(it["source"]).stem, it["caption"], (w, h), (w, h))
        info.latent_cache_path = str(out / f"{info.item_key}_{w:04d}x{h:04d}_{ARCHITECTURE_QWEN_IMAGE}.safetensors")
        info.text_encoder_output_cache_path = str(out / f"{info.item_key}_{ARCHITECTURE_QWEN_IMAGE}_te.safetensors")
        save_latent_cache_qwen_image(info, lat.unsqueeze(1), None)  # musubi: (C, F, H, W)
        save_text_encoder_output_cache_qwen_image(info, emb)
        written.append({"item": info.item_key, "latents": list(lat.shape), "text": list(emb.shape)})
    return {"items": len(written), "first": written[0] if written else None, "dir": str(out)}


def dataset_toml(data: Path, cache: Path, res: int, path: Path) -> Path:
    path.write_text(f"""[general]
resolution = [{res}, {res}]
caption_extension = ".txt"
batch_size = 1
enable_bucket = false

[[datasets]]
image_directory = "{data}"
cache_directory = "{cache}"
num_repeats = 1
""")
    return path


def lorakit_config(a, profile: str, cache_dir: Path, out: Path) -> Path:
    import yaml

    cfg = {"profile": profile, "model": {"family": "qwen-image", "path": str(Path(a.models) / "qwen-image")},
           "data": {"dirs": [str(a.data)], "resolution": a.res, "cache_dir": str(cache_dir)},
           "lora": {"rank": 16, "targets": list(MUSUBI_MODULES)}, "optim": {"lr": 5e-5},
           "schedule": {"steps": a.steps}, "sampling": {"enabled": False},
           "output": {"dir": str(out)}}
    if a.res < 256:  # the harness's own check on the tiny layout (tools/e2e.py --tiny buckets the same way)
        cfg["data"].update(bucket_min_side=32, bucket_max_side=128)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def compare(a) -> None:
    work = Path(a.work)
    out = work / f"peer-{a.setting}"
    out.mkdir(parents=True, exist_ok=True)
    a.data = Path(a.data or work / "data-qwen-image")
    lk_cache = Path(a.cache or work / "qwen-image-datacenter" / "run" / "cache")
    mu_cache = work / "peer-musubi-cache"
    deadline = time.time() + a.limit
    report = {"setting": a.setting, "steps": a.steps, "resolution": a.res, "records": []}
    runs, (profile, cap) = SETTINGS[a.setting]
    order = list(runs) + [("lorakit", None)]
    if a.only:  # these, in this order
        order = [r for label in a.only for r in order if r[0] == label]
    if any(label != "lorakit" for label, _ in order) and not (mu_cache / "done.json").is_file():
        report["export"] = export(lk_cache, mu_cache, Path(a.musubi))  # musubi's cache: only where musubi runs
        (mu_cache / "done.json").write_text(json.dumps(report["export"]))
    toml = dataset_toml(a.data, mu_cache, a.res, out / "dataset.toml")
    shards = sorted((Path(a.models) / "qwen-image" / "transformer").glob("*.safetensors"))
    vae = sorted((Path(a.models) / "qwen-image" / "vae").glob("*.safetensors"))[0]
    env_mu = {"PYTHONPATH": os.pathsep.join([a.musubi, os.environ.get("PYTHONPATH", "")])}
    for label, opts in order:
        left = deadline - time.time()
        if left < 60:
            report["records"].append({"label": label, "skipped": f"{left:.0f} s left of the plan's limit"})
            continue
        if label == "lorakit":
            run_dir = out / "lorakit-run"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            cfg = lorakit_config(a, profile, lk_cache, run_dir)
            env = {"LORAKIT_PROGRESS": "1", **({"LORAKIT_MEMORY_CAP_GIB": str(cap)} if cap else {})}
            rec = measured(f"lorakit-{profile}", ["lorakit", "train", str(cfg), "--json"], out, cap, env, left)
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file():
                recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                rec["step_times"] = [r["time"] for r in recs if "time" in r]
        else:
            mu_out = out / label
            shutil.rmtree(mu_out, ignore_errors=True)
            args = ["musubi_tuner.qwen_image_train_network", "--dit", str(shards[0]), "--vae", str(vae),
                    "--dataset_config", str(toml), *MUSUBI_COMMON, "--max_train_steps", str(a.steps),
                    "--output_dir", str(mu_out), "--output_name", label, *opts, *shlex.split(a.musubi_extra)]
            rec = measured(label, args, out, cap, env_mu, left)
        rec.update(median_step(rec.get("step_times") or []))
        if rec.get("step_times"):
            rec["command_to_first_step_s"] = round(rec["step_times"][0] - rec["started"], 1)
        rec["lora_modules"] = race.lora_modules(out / ("lorakit-run/lora.safetensors" if label == "lorakit" else
                                                  f"{label}/{label}.safetensors"))
        report["records"].append(rec)
        brief = {k: v for k, v in rec.items() if k not in ("step_times", "log_tail", "json", "stdout_tail")}
        print(json.dumps(brief), flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=1))  # after each: a plan stopped midway keeps it
    (out / "report.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    la = sub.add_parser("launch")
    la.add_argument("--stats", required=True)
    la.add_argument("--cap", type=float)
    la.add_argument("module")
    la.add_argument("args", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare")
    c.add_argument("--musubi", required=True, help="musubi-tuner's src/ folder")
    c.add_argument("--models", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    c.add_argument("--steps", type=int, default=30)
    c.add_argument("--res", type=int, default=1024)
    c.add_argument("--data", help="the image folder (default WORK/data-qwen-image)")
    c.add_argument("--cache", help="lorakit's cache (default WORK/qwen-image-datacenter/run/cache)")
    c.add_argument("--limit", type=float, default=1e9, help="seconds for the whole comparison")
    c.add_argument("--musubi-extra", default="", help="more musubi options, one string (e.g. '--num_layers 2')")
    c.add_argument("--only", nargs="*", help="run only these, in this order (lorakit, musubi-documented, ...)")
    a = p.parse_args()
    if a.cmd == "launch":
        launch(a)
    elif a.cmd == "compare":
        compare(a)
    else:
        p.print_help()


if __name__ == "__main__":
    main()
