"""`lorakit bench load|step`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, console, emit, use_json
from lorakit.errors import InputError
from lorakit.models.registry import family_names

HELP = "Measure loading and training speed, side by side with the usual way, in the same run."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("load", help="Compare weight-loading backends (cold/warm page cache, CPU/GPU) in one run.")
def load(path: Path | None = typer.Argument(None, help="a .safetensors file or a (sharded) folder"),
         synthetic: str | None = typer.Option(None, "--synthetic", help="make a test checkpoint of this size, "
                                                 "e.g. 8G (2 shards x 64 bf16 tensors of random bytes)"),
         target: str = typer.Option("auto", "--target", help="cpu, cuda, or auto (both where a GPU exists)"),
         repeats: int = typer.Option(3, "--repeats", min=1, help="runs per cell (median reported)"),
         keep: bool = typer.Option(False, "--keep", help="keep the synthetic files"),
         cache: str = typer.Option("both", "--cache", help="warm, cold or both"),
         drop_caches: bool = typer.Option(False, "--drop-caches", help="cold rows: empty the whole machine's page "
                                          "cache (root; slows everyone on a shared machine) instead of evicting "
                                          "the measured files alone"),
         where: Path | None = typer.Option(None, "--dir", help="where to write synthetic files (default: the "
                                           "temp folder; put them on the disk you load from, not tmpfs)"),
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
    if cache not in ("warm", "cold", "both"):
        raise InputError(f"--cache must be warm, cold or both, got {cache!r}")
    caches = ("warm", "cold") if cache == "both" else (cache,)
    if "cuda" in targets and not torch.cuda.is_available():
        raise InputError("--target cuda, but no CUDA GPU is visible", "use --target cpu")
    if as_json:
        result = bench(path, synthetic, targets, repeats, keep, where=where, caches=caches, drop_caches=drop_caches)
    else:
        with console.status("bench load") as st:
            result = bench(path, synthetic, targets, repeats, keep, progress=lambda s: st.update(f"bench load: {s}"),
                           where=where, caches=caches, drop_caches=drop_caches)
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


@app.command("matrix", help="The user's path at full size: every family x profile through cache, train, infer and "
                            "the stock pipeline, each stage a lorakit process (GPU machine; --tiny on a CPU).")
def matrix(family: list[str] = typer.Option([], "--family", help="families (repeatable; default: all)"),
           profile: list[str] = typer.Option([], "--profile", help="profiles (repeatable; default: datacenter, "
                                             "rtx5090 with a 32 GiB cap, rtx4090 with 24 GiB, dgx-spark)"),
           out: Path = typer.Option(Path("matrix"), "--out", "-o", help="results folder (matrix.json, matrix.md, "
                                    "each cell's logs)"),
           models: Path | None = typer.Option(None, "--models", help="where the model folders are written "
                                              "(default: OUT/models; each is removed after its family)"),
           steps: int = typer.Option(20, "--steps", min=1, help="training steps per cell"),
           stages: str = typer.Option("cache,train,infer,stock", "--stages", help="which stages, comma-separated, of cache, train, train-warm "
                                "(the same training again: a second run's first step), infer, stock"),
           limit: float | None = typer.Option(None, "--limit", help="seconds: start no stage after this"),
           keep_models: bool = typer.Option(False, "--keep-models", help="keep the model folders"),
           cold: bool = typer.Option(False, "--cold", help="evict the model's files from the page cache before "
                                     "each cell's first stage (theirs alone: posix_fadvise)"),
           tiny: bool = typer.Option(False, "--tiny", help="the tiny models on the CPU (checks the plumbing)"),
           gpu_gib: float | None = typer.Option(None, "--gpu-gib", min=1, help="emulate a smaller GPU: datacenter "
                                                "cells held to this many GiB, larger cards run at it (the H100's "
                                                "80 on an H200)"),
           home: list[str] = typer.Option([], "--home", help="COMPONENT=DIR: write that component of each model "
                                          "folder under DIR (another disk, e.g. /dev/shm) and link it (repeatable)"),
           as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    homes: dict = {}
    for h in home:
        name, _, where = h.partition("=")
        if not name or not where or name in homes:
            raise InputError(f"--home {h!r}: not COMPONENT=DIR, or that component named twice",
                             "e.g. --home transformer=/dev/shm/models")
        homes[name] = where
    from dataclasses import asdict

    from lorakit.bench.matrix import PROFILES, STAGES, run_matrix
    from lorakit.models.registry import family_names as names
    from lorakit.quiet import quiet_libraries

    quiet_libraries()
    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    bad = [s for s in chosen if s not in STAGES]
    if bad or not chosen:
        raise InputError(f"--stages: unknown stage {bad[0] if bad else stages!r}", "any of " + ", ".join(STAGES))
    profiles = profile or (["cpu"] if tiny else list(PROFILES))
    cells = run_matrix(family or names(), profiles, out, models, steps, tiny, chosen, limit, keep_models,
                       progress=None if as_json else lambda s: console.print(f"bench matrix: {s}", soft_wrap=True),
                       cold=cold, gpu_gib=gpu_gib, homes=homes)
    emit(as_json, [asdict(c) for c in cells], lambda: console.print((out / "matrix.md").read_text(), markup=False,
                                                                    soft_wrap=True))


@app.command("checkpoint", help="A full fine-tune's checkpoint at full size: sharded (DCP) save, load and async "
                               "save vs the gathered layout vs the disk's own O_DIRECT speed (GPU machine).")
def checkpoint(family: str = typer.Option(family_names()[0], "--family", help="model family (its full-size "
                                          "transformer, random weights)"),
               folder: Path = typer.Option(Path("/tmp/lorakit-bench-checkpoint"), "--dir", help="where to write "
                                           "(emptied after each measurement)"),
               moments: float = typer.Option(2.0, "--moments", help="AdamW moments to include (fewer to fit the "
                                             "card: FLUX with 2 needs ~72 GB)"),
               parts: str = typer.Option("sharded,async,gathered,disk", "--parts", help="which to time, "
                                         "comma-separated: sharded, async, gathered, disk"),
               tiny: bool = typer.Option(False, "--tiny", help="the tiny test architecture (runs on a CPU)"),
               device: str | None = typer.Option(None, "--device", help="cuda:N or cpu (default: cuda:0 if "
                                                 "present)"),
               as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    import torch

    from lorakit.quiet import quiet_libraries

    quiet_libraries()
    from lorakit.bench.checkpoint import PARTS, bench_checkpoint

    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise InputError(f"--parts: unknown part {bad[0] if bad else parts!r}", ", ".join(PARTS))
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not tiny:
        raise InputError("a full-size checkpoint on the CPU needs the whole model in host memory", "add --tiny, or "
                         "run on a GPU")
    result = bench_checkpoint(family, folder, moments, device=device, parts=chosen, size="tiny" if tiny else "full")
    emit(as_json, result, lambda: console.print_json(data=result))


@app.command("step", help="Time lorakit's training step against plain diffusers + peft, in the same run.")
def step(family: str = typer.Option(family_names()[0], "--family", help="model family: " + ", ".join(family_names())),
         res: int = typer.Option(1024, "--res", help="training resolution (square, pixels)"),
         frames: int = typer.Option(1, "--frames", min=1, help="video families: frames per clip (4k + 1, e.g. "
                                                               "17); the memory plan takes it too"),
         steps: int = typer.Option(10, "--steps", min=1, help="timed steps per way (median reported)"),
         warmup: int = typer.Option(3, "--warmup", min=0, help="untimed steps first (compilation, allocator)"),
         profile: str | None = ProfileOpt,
         memory_cap: float | None = typer.Option(None, "--memory-cap", help="GiB: emulate a smaller card"),
         sets: list[str] = typer.Option([], "--set", help="override lorakit's settings, e.g. memory.compile=false"),
         ways: str = typer.Option("plain,lorakit", "--ways", help="which ways to run, comma-separated"),
         attention: str | None = typer.Option(None, "--attention", help="lorakit's SDPA backend "
                                              "(default: the one `lorakit train` takes here: the attention "
                                              "self-test's choice)"),
         tiny: bool = typer.Option(False, "--tiny", help="the tiny test architecture (runs on a CPU)"),
         device: str | None = typer.Option(None, "--device", help="cuda:N or cpu (default: cuda:0 if present)"),
         trace: Path | None = typer.Option(None, "--trace", help="also profile 2 steps per way; summaries here "
                                           "(kernels, idle gaps, host against GPU by region)"),
         gpus: int = typer.Option(1, "--gpus", min=1, help="also run lorakit on N GPUs (one process each; "
                                  "on a CPU: N processes over gloo), throughput against 1 GPU"),
         checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="lorakit rows also save a "
                                                    "checkpoint here, resume from it and continue (timed)"),
         gpus_only: bool = typer.Option(False, "--gpus-only", help="with --gpus N: only the N-GPU row (no "
                                        "one-GPU rows, no throughput ratio)"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.bench.step import bench

    chosen = tuple(w.strip() for w in ways.split(",") if w.strip())
    bad = [w for w in chosen if w not in ("plain", "lorakit")]
    if bad or not chosen:
        raise InputError(f"--ways: unknown way {bad[0] if bad else ways!r}", "plain, lorakit, or both")
    if gpus_only:
        if gpus < 2:
            raise InputError("--gpus-only needs --gpus 2 or more", "e.g. --gpus 2 --gpus-only")
        chosen = ()
    kw = dict(family=family, res=res, frames=frames, profile=profile, steps=steps, warmup=warmup,
              size="tiny" if tiny else "full",
              device=device, memory_cap=memory_cap, sets=sets, ways=chosen, attention=attention,
              trace_dir=str(trace.resolve()) if trace else None, gpus=gpus,
              checkpoint_dir=str(checkpoint_dir.resolve()) if checkpoint_dir else None)
    if as_json:
        result = bench(**kw)
    else:
        with console.status("bench step") as st:
            result = bench(**kw, progress=lambda w: st.update(f"bench step: {w} (child process)"))
    emit(as_json, result, lambda: _render_step(result))


def _render_step(result: dict) -> None:
    from rich.table import Table

    env = result["environment"]
    cap = f", cap {result['memory_cap_gib']} GiB" if result["memory_cap_gib"] else ""
    t = Table(title=f"bench step: {result['family']} {result['res']}² ({result['size']}), profile "
                    f"{result['profile']}{cap}, {env['device']}, median of {result['steps']}", title_justify="left")
    for col in ("way", "GPUs", "s/step", "items/s", "vs plain", "vs 1 GPU", "peak GiB", "MFU", "attention",
                "checkpointing", "note"):
        t.add_column(col, justify="left" if col in ("way", "note") else "right")
    for r in result["rows"]:
        n = str(r.get("gpus", 1))
        if "error" in r:
            t.add_row(r["way"], n, "-", "-", "-", "-", "-", "-", "-", "-",
                      " ".join(x for x in (r["error"], r.get("detail"), r.get("where") and f"at {r['where']}") if x))
            continue
        ck = r.get("checkpoint")
        note = "" if not ck else (f"checkpoint: {ck['error']}" if "error" in ck else
                                  f"checkpoint {ck['gib']} GiB: save {ck['save_s']} s, resume {ck['resume_s']} s")
        t.add_row(r["way"], n, f"{r['s_per_step']:.3f}", f"{r['items_per_s']:.2f}",
                  f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else "-",
                  f"{r['throughput_vs_1gpu']:.2f}x" if "throughput_vs_1gpu" in r else "-",
                  f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-", f"{r['mfu']:.0%}" if "mfu" in r else "-",
                  r.get("attention") or "PyTorch's pick", "on" if r.get("checkpointing") else "off", note)
    console.print(t)
