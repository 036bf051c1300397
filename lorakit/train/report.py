"""What a run leaves for people: metrics.jsonl (+ TensorBoard), the loss curve (drawn with PIL, no plotting
dependency), doctor.json."""

from __future__ import annotations

import json
from pathlib import Path

from lorakit.errors import EnvironmentFault, environment_fault, short
from lorakit.hardware import doctor as doc
from lorakit.hardware.probe import probe
from lorakit.hardware.profiles import choose
from lorakit.io import atomic_path


def window(n: int) -> int:
    """Steps in the loss curve's moving average (a twentieth of the run, at least one)."""
    return max(1, n // 20)


def loss_summary(losses: list[float], first_step: int = 1) -> str:
    """The run's loss in one phrase, the same wherever it is said (the curve's title, the demo): the first step's,
    then the mean of the last steps (the moving average's last point)."""
    k = window(len(losses))
    last = sum(losses[-k:]) / k
    return f"loss {losses[0]:.4f} at step {first_step} -> {last:.4f} " + ("at the last step" if k == 1 else
                                                              f"(mean of the last {k} steps)")


def loss_curve(metrics: Path, out: Path, size=(640, 360)) -> Path:
    """Loss per step (thin) and its moving average (thick), and the held-out val_loss (orange dots joined) where
    the run measured it, on a log-free linear axis."""
    from PIL import Image, ImageDraw

    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    w, h = size
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    pad = 40

    if not rows:
        d.text((pad, h // 2), "no steps recorded", fill="black")
        with atomic_path(out) as tmp:
            img.save(tmp, format="PNG")
        return out
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    k = window(len(loss))
    avg = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    lo, hi = min(loss + [v for _, v in val]), max(loss + [v for _, v in val])
    hi = hi if hi > lo else lo + 1e-9
    s0, s1 = steps[0], max(steps[-1], steps[0] + 1)

    def xy(s, v):
        return pad + (s - s0) / (s1 - s0) * (w - 2 * pad), h - pad - (v - lo) / (hi - lo) * (h - 2 * pad)

    d.rectangle([pad, pad, w - pad, h - pad], outline=(180, 180, 180))
    d.line([xy(s, v) for s, v in zip(steps, loss, strict=True)], fill=(160, 190, 230), width=1)
    d.line([xy(s, v) for s, v in zip(steps, avg, strict=True)], fill=(20, 70, 180), width=3)
    title = loss_summary(loss, steps[0])
    if val:
        pts = [xy(s, v) for s, v in val]
        if len(pts) > 1:
            d.line(pts, fill=(230, 120, 20), width=2)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(230, 120, 20))
        title += f"; val_loss (orange): {val[0][1]:.4f} -> {val[-1][1]:.4f}"
    d.text((pad, 10), title, fill="black")
    d.text((pad, h - pad + 8), f"step {s0}", fill="black")
    d.text((w - pad - 60, h - pad + 8), f"step {steps[-1]}", fill="black")
    d.text((4, pad), f"{hi:.3g}", fill="black")
    d.text((4, h - pad - 12), f"{lo:.3g}", fill="black")
    with atomic_path(out) as tmp:
        img.save(tmp, format="PNG")
    return out


def doctor_summary(out_dir: Path, profile: str, attention: str | None) -> Path:
    """`doctor.json` beside the LoRA: the machine (probe), the profile and why, the quick checks and the
    attention backend this run used — what a bug report about the run needs."""
    facts = probe(out_dir)
    choice = choose(profile, facts)
    results = doc.checks(facts, choice)
    data = {"summary": doc.summary(results), "profile": {"name": choice.profile.name, "reason": choice.reason},
            "attention_used": attention, "checks": doc.to_dicts(results), "facts": facts.to_dict()}
    path = out_dir / "doctor.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=str))
    return path


class MetricsLog:
    """metrics.jsonl (always) and TensorBoard scalars (when installed), written by rank 0.

    A fresh run starts a new file; a resumed one keeps the lines up to the step it resumes from (steps logged
    after the checkpoint it continues from are dropped, so each step appears once). TensorBoard is a
    convenience: when its writer fails (a full disk), it is turned off with one warning, and its background
    thread's traceback is not printed; metrics.jsonl failing is an error naming the file."""

    def __init__(self, out_dir: Path, resumed_at: int | None, main: bool = True, warn=None, wandb_run=None):
        self.path = out_dir / "metrics.jsonl"
        self.main = main
        self.warn = warn or (lambda msg: None)
        self.tb = None
        self.wandb = None
        self._hook = None
        if not main:
            return
        self.wandb = wandb_run  # started at the beginning of the run (`start_wandb`)

        if self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and resumed_at is not None
                    and json.loads(ln)["step"] <= resumed_at]
            with atomic_path(self.path) as tmp:
                tmp.write_text("".join(ln + "\n" for ln in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        import threading

        previous = threading.excepthook

        def quiet(args):  # the TensorBoard writer thread: recorded and reported once, not printed
            if type(args.thread).__name__ == "_AsyncWriterThread":
                return
            previous(args)

        self._hook = previous
        threading.excepthook = quiet
        try:
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        except OSError as e:
            self._tb_failed(e)

    def _tb_failed(self, e: BaseException) -> None:
        self.tb = None
        self.warn(f"TensorBoard logging turned off: {short(e, 120)} (metrics.jsonl goes on)")

    def write(self, rec: dict) -> None:
        if not self.main:
            return

        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            raise environment_fault(e, self.path) or e from None
        if self.tb is not None:
            try:
                for k, v in rec.items():
                    if k != "step" and not isinstance(v, str):  # scalars (the bucket's "WxH" stays in the jsonl)
                        self.tb.add_scalar(f"train/{k}", v, rec["step"])
            except Exception as e:  # noqa: BLE001 - any writer fault only turns TensorBoard off
                self._tb_failed(e)
        if self.wandb is not None:
            try:
                self.wandb.log({f"train/{k}": v for k, v in rec.items()
                                if k not in ("step", "time") and not isinstance(v, str)}, step=rec["step"])
            except Exception as e:  # noqa: BLE001 - a logging service fault does not stop training
                self._wandb_failed(e)

    def image(self, name: str, path: Path | None, step: int) -> None:
        """A sample grid to W&B (metrics.jsonl and TensorBoard take scalars only)."""
        if self.wandb is not None and path is not None:
            try:
                import wandb

                self.wandb.log({name: wandb.Image(str(path))}, step=step)
            except Exception as e:  # noqa: BLE001
                self._wandb_failed(e)

    def _wandb_failed(self, e: BaseException) -> None:
        self.wandb = None
        self.warn(f"W&B logging turned off: {short(e, 120)} (metrics.jsonl goes on)")

    def finish(self, summary: dict | None = None) -> None:
        """End the W&B run (after the last samples), with the run's result in its summary."""
        if self.wandb is not None:
            try:
                if summary:
                    self.wandb.summary.update(summary)
                self.wandb.finish()
            except Exception as e:  # noqa: BLE001
                self._wandb_failed(e)
            self.wandb = None

    def close(self) -> None:
        import threading

        if self.tb is not None:
            try:
                self.tb.close()
            except Exception as e:  # noqa: BLE001
                self._tb_failed(e)
        if self._hook is not None:
            threading.excepthook = self._hook
            self._hook = None


def require_wandb():
    """wandb, or an environment fault saying how to get it (checked before any weights load)."""
    try:
        import wandb
    except ImportError:
        raise EnvironmentFault("logging.wandb is on but wandb is not installed",
                               "pip install 'lorakit[wandb]', or --set logging.wandb=false") from None
    return wandb


def start_wandb(cfg, out_dir: Path, resuming: bool):
    """A W&B run for this training run (its id kept in the output folder, so a resumed run continues it).

    Raises:
        EnvironmentFault: W&B could not start (no API key, no network, a bad WANDB_* setting), naming the service
            and what to do, before the run loads anything.
    """
    import time

    wandb = require_wandb()

    id_file = out_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    try:
        run = wandb.init(project=cfg.logging.wandb_project, dir=str(out_dir), config=cfg.to_dict(),
                         name=cfg.logging.wandb_run_name or f"{cfg.output.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                         mode=cfg.logging.wandb_mode, id=run_id, resume="allow" if run_id else None)
    except Exception as e:  # noqa: BLE001 - every way W&B fails to start is the service's, said as such
        said = " ".join(str(e).split())
        raise EnvironmentFault(f"W&B (logging.wandb) could not start: {type(e).__name__}: {said[:240]}",
                               "check `wandb login` / WANDB_API_KEY and the network, or log offline with "
                               "WANDB_MODE=offline (`wandb sync` later), or --set logging.wandb=false") from None
    id_file.write_text(run.id)
    return run


def peak_rss_gib() -> float:
    """This process's peak resident memory in GiB (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 2)


class Timeline(dict):
    """phase -> seconds since it was made; `mark(phase)` records a phase's first time only."""

    def __init__(self):
        super().__init__()
        import time

        self._t0 = time.perf_counter()

    def __call__(self, phase: str) -> None:
        import time

        self.setdefault(phase, round(time.perf_counter() - self._t0, 2))


class Notes(list):
    """Warnings collected in order; each is also handed to `warn` (if given) as it happens."""

    def __init__(self, warn=None):
        super().__init__()
        self._warn = warn

    def __call__(self, msg: str) -> None:
        self.append(msg)
        if self._warn:
            self._warn(msg)
