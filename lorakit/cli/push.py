"""`lorakit push`: a finished run to the Hugging Face Hub (a Hub-ready folder, uploaded when online)."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, console, emit, use_json

HELP = """Share a finished run on the Hugging Face Hub: RUN_DIR/hub/ gets the LoRA, the latest sample grid and a
model card (base_model, license, tags, trigger words, widget, training settings); it is uploaded to REPO with
huggingface_hub when the machine is online (`hf auth login` first). Offline (HF_HUB_OFFLINE=1) the folder is
written and the upload command printed."""


def push(run_dir: Path = typer.Argument(..., help="the run's output.dir (lora.safetensors, config.resolved.yaml)"),
         repo: str = typer.Argument(..., help="org/name on the Hub"),
         base_model: str | None = typer.Option(None, "--base-model", help="the base model's repo id (default: "
                                               "found from a model in the hub's cache)"),
         license: str = typer.Option("other", "--license", help="the LoRA's licence (the base model's terms "
                                     "apply to it too)"),
         private: bool = typer.Option(False, "--private", help="create the repo private"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.errors import InputError
    from lorakit.hub import push as do_push
    from lorakit.models.sources import check_repo_id

    if "@" in repo or repo.count("/") != 1:
        raise InputError(f"REPO {repo!r}: not a Hub repo name", "org/name, e.g. me/my-flux-lora")
    check_repo_id(repo, "REPO")
    res = do_push(run_dir, repo, base_model, license, private)

    def render():
        console.print(f"wrote {res['folder']} ({', '.join(res['files'])})", soft_wrap=True)
        for w in res["warnings"]:
            console.print(f"[yellow]warning:[/] {w}", soft_wrap=True)
        console.print(f"uploaded: {res['url']}" if res["uploaded"] else f"not uploaded: {res['how']}",
                      soft_wrap=True, markup=False)

    emit(as_json, res, render)
