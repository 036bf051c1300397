"""`lorakit bench load|step`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, console, emit, use_json
from lorakit.cli.pending import not_in_this_build
from lorakit.errors import InputError

HELP = "Measure loading and training speed, side by side with the usual way, in the same run."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("load", help="Compare weight-loading backends (cold/warm page cache, CPU/GPU) in one run.")
def load(path: Path | None = typer.Argument(None, help="a .safetensors file or a (sharded) folder"),
         synthetic: str | None = typer.Option(None, "--synthetic", help="make a test checkpoint of this size, "
                                                 "e.g. 8G (2 shards x 64 bf16 tensors of random bytes)"),
         target: str = typer.Option("auto", "--target", help="cpu, cuda, or auto (both where a GPU exists)"),
         repeats: int = typer.Option(3, "--repeats", min=1, help="runs per cell (median reported)"),
         keep: bool = typer.Option(False, "--keep", help="keep the synthetic files"),
         model_dir: Path | None = typer.Option(None, "--model-dir", help="time a whole pipeline folder to "
                                               "'components ready on the device', as train loads it"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    import torch

    from lorakit.bench.load import bench, bench_model_dir

    if model_dir is not None:
        from lorakit.quiet import quiet_libraries

        quiet_libraries()
        dev = "cuda" if torch.cuda.is_available() and target != "cpu" else "cpu"
        result = bench_model_dir(model_dir, dev, repeats=repeats)
        emit(as_json, result, lambda: console.print(
            f"{result['model_dir']} ({', '.join(result['components'])}) -> {dev}: "
            + ", ".join(f"{r['way']} {r['seconds']:.3f} s" for r in result["rows"])))
        return

    if target == "auto":
        targets = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    elif target in ("cpu", "cuda"):
        targets = (target,)
    else:
        raise InputError(f"--target must be cpu, cuda or auto, got {target!r}")
    if "cuda" in targets and not torch.cuda.is_available():
        raise InputError("--target cuda, but no CUDA GPU is visible", "use --target cpu")
    if as_json:
        result = bench(path, synthetic, targets, repeats, keep)
    else:
        with console.status("bench load") as st:
            result = bench(path, synthetic, targets, repeats, keep, progress=lambda s: st.update(f"bench load: {s}"))
    emit(as_json, result, lambda: _render_load(result))


def _render_load(result: dict) -> None:
    from rich.table import Table

    rows = result["rows"]
    base = {(r["cache"], r["target"]): r["seconds"] for r in rows if r["way"] == "safetensors"}
    t = Table(title=f"bench load: {result['bytes'] / 2**30:.2f} GiB in {len(result['files'])} file(s)",
              title_justify="left")
    for col in ("way", "cache", "target", "s", "GB/s", "vs safetensors", "peak GPU GiB", "RSS +GiB", "exact"):
        t.add_column(col, justify="right" if col not in ("way", "cache", "target") else "left")
    for r in rows:
        ref = base.get((r["cache"], r["target"]))
        ratio = f"{ref / r['seconds']:.2f}x" if ref and r["seconds"] else "-"
        t.add_row(r["way"], r["cache"], r["target"], f"{r['seconds']:.3f}" if r["seconds"] else r["note"] or "-",
                  f"{r['gbps']:.2f}" if r["gbps"] else "-", ratio,
                  "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}",
                  "-" if r["rss_growth_gib"] is None else f"{r['rss_growth_gib']:.2f}",
                  {True: "yes", False: "NO", None: "-"}[r["exact"]])
    console.print(t)
    if result.get("cold_method"):
        console.print(f"cold: page cache dropped with {result['cold_method']}")


@app.command("step", help="Time lorakit's training step against plain diffusers + peft.")
def step(family: str = typer.Option("flux", "--family"), res: int = typer.Option(1024, "--res"),
         steps: int = typer.Option(10, "--steps"), profile: str | None = ProfileOpt,
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit bench step`", 8, "see ../shared/BASELINES.md for measured baselines")
