"""What a resume may continue: the checkpoint a `--resume` names (found before anything is built), a LoRA of the
same shape, and the same learning-rate schedule — each difference refused by name, or continued where the user says
so (`schedule.reschedule_on_resume`)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from lorakit.errors import InputError
from lorakit.train.optim import lr_lambda

SCHEDULE_KEYS = ("steps", "lr_schedule", "warmup_steps")


def schedule_facts(cfg) -> dict:
    """The settings the learning rate follows (saved in each checkpoint's state)."""
    return {**{k: getattr(cfg.schedule, k) for k in SCHEDULE_KEYS}, "lr": cfg.optim.lr}


def check_schedule(cfg, state: dict, step: int, where: str) -> tuple[list[str], bool]:
    """Notes on a schedule that changed since the checkpoint, and whether the learning rate must follow the new one
    (its peak set anew).

    Raises:
        InputError: the change would change the learning rate from here on and reschedule_on_resume is off.
    """
    was, now = state.get("schedule"), schedule_facts(cfg)
    if not was or was == now or step >= now["steps"]:  # the same, or no step left to take
        return [], False
    changed = ", ".join(f"{k} {was[k]} -> {now[k]}" for k in now if was.get(k) != now[k])
    old, new = _lrs(cfg, was), _lrs(cfg, now)
    end = max(min(was["steps"], now["steps"]), step + 1)  # the steps still to take that both schedules cover
    same = all(math.isclose(old(s), new(s), rel_tol=1e-9) for s in range(step, end))
    if same:  # e.g. more steps of a constant rate: nothing the optimizer sees changes
        return [f"schedule: {changed}; the learning rate continues unchanged"], False
    if not cfg.schedule.reschedule_on_resume:
        raise InputError(f"{where} was written with another learning-rate schedule ({changed}): resuming would "
                         f"move the learning rate at step {step} from {old(step):.3g} to {new(step):.3g}",
                         "resume with the checkpoint's schedule settings, or --set schedule.reschedule_on_resume="
                         "true to follow the new schedule from this step")
    return [f"schedule: {changed}; the learning rate follows the new schedule from step {step} "
            f"({old(step):.3g} -> {new(step):.3g})"], True


def _lrs(cfg, facts: dict):
    f = lr_lambda(cfg.model_copy(update={"schedule": cfg.schedule.model_copy(
        update={k: facts[k] for k in SCHEDULE_KEYS})}))
    return lambda s: facts["lr"] * f(s)


def check_lora_shapes(model_sd: dict, saved: dict, where: str) -> None:
    """The checkpoint's LoRA tensors have the shapes of this run's adapter (rank, targets), or the two are named.

    Raises:
        InputError: another rank, or other modules.
    """
    saved = {k.removeprefix("transformer."): v for k, v in saved.items() if not k.endswith(".dora_scale")}
    model_sd = {k.removeprefix("transformer."): v for k, v in model_sd.items()}
    for k, v in saved.items():
        mine = model_sd.get(k)
        if mine is not None and tuple(mine.shape) != tuple(v.shape):
            raise InputError(f"{where} holds a LoRA of another shape: {k} is {list(v.shape)} there, "
                             f"{list(mine.shape)} in this run ({_rank(v.shape, k)} against {_rank(mine.shape, k)})",
                             "resume with the checkpoint's lora settings (lora.rank, lora.targets), or start a new "
                             "run in another output.dir")
    missing = sorted(set(model_sd) - set(saved))
    extra = sorted(set(saved) - set(model_sd))
    if missing or extra:
        what = (f"{len(extra)} LoRA tensors this run's adapter does not have (e.g. {extra[0]})" if extra else
                f"no LoRA tensors for {len(missing)} of this run's (e.g. {missing[0]})")
        raise InputError(f"{where} holds {what}: lora.targets or the model differ from the checkpoint's",
                         "resume with the checkpoint's lora settings, or start a new run in another output.dir")


def _rank(shape, key: str) -> str:
    r = shape[0] if "lora_A" in key or "lora_down" in key else shape[-1] if len(shape) > 1 else shape[0]
    return f"rank {r}"


def find(out: Path, resume: str, full: bool, latest) -> tuple[Path | None, list[str]]:
    """The checkpoint `--resume` names, found before anything loads: "latest" (the newest intact; none is an
    error), "auto" (the same, or a fresh start when the run has none), or a folder. Returns it (None: start fresh)
    and notes.

    Raises:
        InputError: no such folder; latest with no intact checkpoint.
    """
    if resume not in ("latest", "auto"):
        ck = Path(resume)
        if not ck.is_dir():
            raise InputError(f"--resume {resume}: no such checkpoint folder",
                             f"--resume latest (or auto) takes the newest under {out / 'checkpoints'}")
        return ck, []
    ck, notes = latest(out, full)
    if ck is None and resume == "latest":
        raise InputError(f"--resume latest: no intact checkpoint in {out / 'checkpoints'}",
                         "start without --resume, or use --resume auto (resumes when there is a checkpoint, starts "
                         "fresh otherwise)" + (" (the checkpoints there are damaged)" if notes else ""))
    return ck, notes  # None with auto: a fresh start (the run says so as information, not as a warning)


def earlier_run(out: Path, name: str) -> str | None:
    """What an earlier run left in `out` that a new run there would overwrite or mix with its own — "a finished run
    (its final checkpoint, N steps recorded)" and the like — or None when the folder holds none of it."""
    ck = out / "checkpoints"
    steps = 0
    try:
        with open(out / "metrics.jsonl", "rb") as f:
            steps = sum(1 for _ in f)
    except OSError:
        pass
    saved = sorted(p.name for p in ck.iterdir() if p.is_dir() and _holds_files(p)) if ck.is_dir() else []
    lora = [p.name for p in (out / f"{name}.safetensors", out / f"{name}-transformer") if p.exists()]
    if not (steps or saved or lora):
        return None
    state = "a finished run" if "final" in saved or lora else "an interrupted run" if saved else "a run"
    parts = [f"{steps} metrics line(s)"] if steps else []
    parts += [f"checkpoints {', '.join(saved[-3:])}"] if saved else []
    parts += lora
    return f"{state} ({'; '.join(parts)})"


def _holds_files(folder: Path) -> bool:
    """A checkpoint folder with something written in it (a write killed before its first file left only a
    temporary one: nothing to keep)."""
    return any(f.is_file() and not f.name.endswith(".tmp") for f in folder.rglob("*"))


RESULTS = ("metrics.jsonl", "phases.jsonl", "checkpoints", "samples", "tensorboard", "loss_curve.png")


def check_fresh_start(out: Path, name: str, resume: str | None, force: bool) -> str | None:
    """A run that does not resume into a folder holding an earlier run's results is refused (its metrics would be
    truncated, some checkpoints overwritten, others kept — and a later `--resume latest` would continue the old
    run's step). `--force` starts over: what the earlier run wrote is removed (see `clear_results`); returns the note
    saying so. `--resume` (auto included: a job's requeue) continues instead.

    Raises:
        InputError: the folder holds an earlier run and neither --resume nor --force was given.
    """
    if resume is not None:
        return None
    found = earlier_run(out, name)
    if found is None:
        return None
    if not force:
        raise InputError(f"output.dir {out} holds {found}: a new run there would overwrite part of it",
                         "--resume latest continues it; --force starts over (its results are removed first); or "
                         "give this run another output.dir")
    return f"--force: output.dir {out} held {found}; removed, starting over"


def clear_results(out: Path, name: str) -> None:
    """Remove what a run writes into its output folder (`RESULTS`, the LoRA file, an exported transformer), leaving
    whatever else the user keeps there."""
    for entry in (*RESULTS, f"{name}.safetensors", f"{name}-transformer"):
        p = out / entry
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
