"""lorakit beside ai-toolkit (ostris) training the same LoRA on the same GPU, data and random-weight folder, each
side timed as the wall clock shows it (tools/race.py's `measure`): command -> first step, -> the final LoRA file
(the whole job), steady s/step (median and p90 of the wall time between consecutive steps after the second),
GPU peak (NVML) and the private host peak of the process tree.

    python tools/race.py synth --family flux --models M && python tools/race.py data --out D --count 16
    python tools/peer_aitoolkit.py race --aitk SRC --family flux --models M --data D --work W \
        --setting datacenter|24gb --steps 300 [--only aitk lorakit]

SRC is a checkout of ai-toolkit (github.com/ostris/ai-toolkit); its runtime packages must be importable, from
`--aitk-path DIR` (put first on ai-toolkit's PYTHONPATH alone: it pins a diffusers commit of its own, lorakit keeps
its own) or the environment. ai-toolkit is not part of lorakit; docs/benchmarks.md names the commit and versions
measured. ai-toolkit runs ITS documented
config for the case, `config/examples/train_lora_<flux|qwen_image>_24gb.yaml` read from SRC, with only these
changes (each said in the report's `changed`):
  - the model folder, the dataset folder, the output folder, the steps, device;
  - resolution [1024] instead of [512, 768, 1024]: both trainers see the same 1024-class buckets;
  - the LoRA on lorakit's default modules (`network_kwargs.only_if_contains`: the family's attention preset), rank
    and alpha 16 as documented — both train the same modules;
  - save_every = steps: one LoRA file at the end, as lorakit writes (no intermediate saves);
  - sample_every = steps: a grid before the first step and after the last, as lorakit's default (its own 10
    prompts at 20 steps kept);
  - `datacenter`: quantize / quantize_te off (the 80 GB card needs no 8-bit base); `24gb`: as documented, and both
    processes held to 24 GiB (`lorakit.hardware.gpu.apply_cap`: the CUDA context inside the cap, as on the card);
  - a `qtype` naming an accuracy recovery adapter on a hub (`uint3|ostris/...`, its Qwen-Image 24 GB example): the
    quantisation kept, the adapter left out (the race's machine reaches no hub; it is a LoRA on every quantised
    Linear, so ai-toolkit's step does less than as documented).
lorakit runs `lorakit train` as a user does (race.py's lorakit side: own YAML, the profile's defaults, rtx4090
under the 24 GiB cap). ai-toolkit's steps are timed where it counts them (its progress bar's update, through the
launcher below); lorakit's from metrics.jsonl. `--tiny` runs both on the tiny layout on a CPU (the tool's test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # noqa: E402 - tools/ is not a package

EXAMPLES = {"flux": "train_lora_flux_24gb.yaml", "qwen-image": "train_lora_qwen_image_24gb.yaml"}


# ---- in the measured process ----

def launch(a) -> None:
    """ai-toolkit's run.py as __main__ (cwd = SRC, as its docs run it), with the cap applied and the time of each
    progress-bar update (one per optimizer step) written to `--stats` at exit."""
    import runpy

    import torch

    log = race.StepLog(a.stats, a.cap)
    if not a.cudnn_sdpa:  # see race --aitk-cudnn-sdpa
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.rec["cudnn_sdpa"] = False
    os.chdir(a.aitk)
    sys.path.insert(0, a.aitk)
    from toolkit.progress_bar import ToolkitProgressBar

    update = ToolkitProgressBar.update

    def timed(self, n=1):
        out = update(self, n)
        if n and not self.paused:
            log.step(int(n))
        return out
    ToolkitProgressBar.update = timed
    sys.argv = ["run.py", a.config]
    runpy.run_path(str(Path(a.aitk) / "run.py"), run_name="__main__")


# ---- the driver ----

def aitk_config(a, out: Path) -> tuple[Path, list[str]]:
    """ai-toolkit's documented example for the family, with the race's changes (module docstring); returns the
    written YAML and the list of what was changed."""
    from lorakit.models.base import family_adapter

    doc = yaml.safe_load((Path(a.aitk) / "config" / "examples" / EXAMPLES[a.family]).read_text())
    proc = doc["config"]["process"][0]
    doc["config"]["name"] = "aitk"
    changed = ["model, dataset and output folders", f"steps {proc['train']['steps']} -> {a.steps}"]
    proc["training_folder"] = str(out)
    proc["device"] = "cpu" if a.tiny else "cuda:0"
    proc["model"]["name_or_path"] = str(Path(a.models) / a.family)
    ds = proc["datasets"][0]
    ds["folder_path"] = str(a.data)
    res = 64 if a.tiny else 1024
    changed.append(f"resolution {ds['resolution']} -> [{res}]")
    ds["resolution"] = [res]
    proc["train"]["steps"] = a.steps
    modules = [f"attn.{m}" for m in family_adapter(a.family).preset_modules("attention")]
    proc["network"]["network_kwargs"] = {"only_if_contains": modules}
    changed.append("LoRA modules: lorakit's attention preset (" + ", ".join(modules) + ")")
    proc["save"]["save_every"] = a.steps
    proc["sample"]["sample_every"] = a.steps
    changed.append(f"save_every and sample_every {a.steps} (one file, grids before and after)")
    if a.setting == "datacenter":
        proc["model"]["quantize"] = False
        proc["model"]["quantize_te"] = False
        changed.append("quantize and quantize_te off (80 GB card)")
    qtype, _, adapter = str(proc["model"].get("qtype", "")).partition("|")
    if adapter and not Path(adapter).is_file():  # its Qwen-Image 24 GB example: uint3 + a LoRA of the hub's
        proc["model"]["qtype"] = qtype
        changed.append(f"qtype {qtype}|{adapter} -> {qtype}: its accuracy recovery adapter is a hub download "
                       "(a LoRA on every quantised Linear: without it ai-toolkit's step does less)")
    if a.tiny:
        proc["sample"]["sample_steps"] = 2
        proc["sample"]["width"] = proc["sample"]["height"] = 64
        proc["sample"]["prompts"] = proc["sample"]["prompts"][:2]
        proc["train"]["optimizer"] = "adamw"  # bitsandbytes' 8-bit AdamW needs a GPU
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, changed


def aitk_run(a, work: Path) -> dict:
    out = work / f"aitk-{a.setting}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg, changed = aitk_config(a, out)
    stats = work / f"aitk-{a.setting}.stats.json"
    stats.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "launch", "--aitk", str(Path(a.aitk).resolve()),
           "--stats", str(stats), *(["--cap", str(a.cap)] if a.cap else []),
           *(["--cudnn-sdpa"] if a.aitk_cudnn_sdpa else []), str(cfg)]
    path = [*(a.aitk_path or []), str(Path(a.aitk).resolve()), os.environ.get("PYTHONPATH")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), "NO_ALBUMENTATIONS_UPDATE": "1",
           "HF_HUB_OFFLINE": "1"}
    # ai-toolkit's final LoRA: TRAINING_FOLDER/<name>/<name>.safetensors
    return race.peer_record(a, cmd, env, work / f"aitk-{a.setting}.log", stats, out / "aitk" / "aitk.safetensors",
                            "ai-toolkit", changed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--aitk", required=True)
    race.add_launch_args(la)
    la.add_argument("--cudnn-sdpa", action="store_true")
    la.add_argument("config")
    r = sub.add_parser("race")
    r.add_argument("--aitk", required=True, help="a checkout of ai-toolkit")
    r.add_argument("--aitk-path", action="append", help="a folder of ai-toolkit's own packages (its pinned "
                   "diffusers, ...), put first on its PYTHONPATH only: lorakit keeps its own")
    r.add_argument("--aitk-cudnn-sdpa", action="store_true", help="leave torch's cuDNN attention on for ai-toolkit "
                   "(off by default: on torch 2.11 / cuDNN 9.19 its backward failed ai-toolkit's first step, "
                   "'mha_graph.execute ... is_good()' / illegal memory access; flash and efficient SDPA stay on)")
    race.add_race_args(r, sorted(EXAMPLES), "aitk")
    a = p.parse_args()
    launch(a) if a.cmd == "launch" else race.race_peer(a, "ai-toolkit", "aitk", aitk_run)


if __name__ == "__main__":
    main()
