"""Sharing a run on the Hugging Face Hub: a Hub-ready folder (the LoRA, sample images, a model card whose metadata
huggingface_hub's ModelCard parses: base_model, license, tags, trigger words, widget, training settings), uploaded
with huggingface_hub when the machine is online; offline the folder is written and the upload command said."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from lorakit.errors import EnvironmentFault, InputError
from lorakit.io import atomic_path
from lorakit.models.base import family_adapter
from lorakit.models.sources import offline, repo_of_snapshot

TASK = {"flat": "text-to-image", "edit": "image-to-image", "edit-plus": "image-to-image", "video": "text-to-video"}


def base_model_of(path: str) -> str | None:
    """The repo id of a model folder in the hub's cache (models--org--name/snapshots/<commit>), else None."""
    return repo_of_snapshot(path)


def hub_folder(run_dir: Path, repo: str, base_model: str | None = None, license: str = "other") -> dict:
    """Write RUN_DIR/hub/: lora.safetensors, images/ (the latest sample grid), README.md (the model card). Returns
    what was written, and warnings (a base model not known, no samples).

    Raises:
        InputError: not a finished lorakit run folder.
    """
    run_dir = Path(run_dir)
    cfg_file, lora = run_dir / "config.resolved.yaml", run_dir / "lora.safetensors"
    missing = [p.name for p in (cfg_file, lora) if not p.is_file()]
    if missing:
        raise InputError(f"{run_dir} is not a finished lorakit run (no {', '.join(missing)})",
                         "give the run's output.dir after `lorakit train` finished")
    cfg = yaml.safe_load(cfg_file.read_text())
    family, warnings = cfg["model"]["family"], []
    base = base_model or base_model_of(cfg["model"].get("path") or "")
    if base is None:
        warnings.append("no base_model in the card: the model folder is not in the hub's cache; give --base-model "
                        "org/name")
    out = run_dir / "hub"
    (out / "images").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lora, out / "lora.safetensors")
    grids = sorted((run_dir / "samples").glob("step-*.png"))
    prompts = (cfg.get("sampling") or {}).get("prompts") or []
    widget = []
    if grids:
        shutil.copyfile(grids[-1], out / "images" / grids[-1].name)
        widget = [{"text": prompts[0] if prompts else family, "output": {"url": f"images/{grids[-1].name}"}}]
    else:
        warnings.append("no sample images in the run (sampling.enabled was false): the card has no widget")
    trigger = (cfg.get("data") or {}).get("trigger")
    meta = {"base_model": base, "license": license, "library_name": "diffusers",
            "pipeline_tag": TASK.get(family_adapter(family).layout, "text-to-image"),
            "tags": ["lora", "diffusers", "lorakit", family, TASK.get(family_adapter(family).layout, "text-to-image")],
            "instance_prompt": trigger, "widget": widget}
    meta = {k: v for k, v in meta.items() if v not in (None, [], "")}
    card = "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + _body(cfg, repo, base, trigger, grids)
    with atomic_path(out / "README.md") as tmp:
        tmp.write_text(card)
    return {"folder": str(out), "repo": repo, "files": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                                            if p.is_file()), "warnings": warnings}


def _body(cfg: dict, repo: str, base: str | None, trigger: str | None, grids: list[Path]) -> str:
    s, lo, data = cfg.get("schedule", {}), cfg.get("lora", {}), cfg.get("data", {})
    optim = cfg.get("optim", {})
    lines = [f"# {repo.split('/')[-1]}", "",
             f"A LoRA for {base or cfg['model']['family']}, trained with lorakit "
             f"({cfg['model']['family']}).", ""]
    if trigger:
        lines += [f"Trigger words: `{trigger}`", ""]
    if grids:
        lines += [f"![samples](images/{grids[-1].name})", ""]
    lines += ["## Use it", "", "```python", "import torch", "from diffusers import DiffusionPipeline", "",
              f"pipe = DiffusionPipeline.from_pretrained({base or '<the base model>'!r}, torch_dtype=torch.bfloat16)",
              f"pipe.load_lora_weights({repo!r}, weight_name='lora.safetensors')", "```", "",
              "## Training settings", "",
              "| setting | value |", "|---|---|",
              f"| steps | {s.get('steps')} |", f"| batch size x accumulation | {s.get('batch_size')} x "
              f"{s.get('grad_accum')} |", f"| learning rate, schedule | {optim.get('lr')}, {s.get('lr_schedule')} "
              f"(warmup {s.get('warmup_steps')}) |", f"| optimizer | {optim.get('name')} |",
              f"| LoRA | {lo.get('type', 'lora')}, rank {lo.get('rank')}, alpha {lo.get('alpha') or lo.get('rank')}, targets "
              f"{lo.get('targets')} |", f"| resolution | {data.get('resolution')} |",
              f"| base dtype | {cfg['model'].get('dtype')} |", ""]
    return "\n".join(lines)


def push(run_dir: Path, repo: str, base_model: str | None = None, license: str = "other",
         private: bool = False) -> dict:
    """`hub_folder`, then the upload (online), or the command that uploads it (offline).

    Raises:
        EnvironmentFault: the hub refused or could not be reached (the folder stays written).
    """
    got = hub_folder(run_dir, repo, base_model, license)
    if offline():
        got.update(uploaded=False, how=f"hf upload {repo} {got['folder']} . (HF_HUB_OFFLINE=1: not uploaded)")
        return got
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo, folder_path=got["folder"], commit_message="lorakit: upload LoRA")
    except Exception as e:  # noqa: BLE001 - the hub's errors (auth, network, quota) are the machine's answer
        status = getattr(getattr(e, "response", None), "status_code", None)
        then = f"then `hf upload {repo} {got['folder']} .` (the folder is written)"
        if status in (401, 403):
            hint = f"the hub refused the credentials: `hf auth login` with a token that may write to {repo}, {then}"
        elif status is None and _unreachable(e):
            hint = f"the hub could not be reached from here: check the network (or a proxy), {then}"
        else:
            hint = f"`hf auth login` if the token is missing, {then}"
        raise EnvironmentFault(f"uploading {got['folder']} to {repo} failed: {e}", hint) from None
    got.update(uploaded=True, url=str(getattr(info, "commit_url", info)))
    return got


def _unreachable(e: BaseException) -> bool:
    """A failure to reach the hub at all (no network, DNS, a refused or timed-out connection), through the chain of
    causes huggingface_hub and its HTTP client wrap it in."""
    seen = 0
    while e is not None and seen < 8:
        name = type(e).__name__
        if isinstance(e, (ConnectionError, TimeoutError)) or name in ("ConnectError", "ConnectTimeout", "ConnectionError",
                                                                     "NameResolutionError", "MaxRetryError",
                                                                     "OfflineModeIsEnabled"):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
