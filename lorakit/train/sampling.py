"""Samples during training: fixed prompts (and control images for edit families) rendered by the model being
trained, before the first step, every `sampling.every` steps and at the end, into PNG grids.

The sampler integrates the family's velocity (`adapter.predict`, the same call the training loss uses and the
tests match against the stock pipelines) with Euler steps over the scheduler's shifted sigmas, so it needs no
text encoder while training: prompts are encoded once at the start. A family whose guidance is embedded
(FLUX) takes `sampling.guidance` as a model input; the others (`guidance: cfg` in their adapter) use
classifier-free guidance against the empty caption when `sampling.guidance` > 1. The noise of image k is seeded with `sampling.seed + k`: every grid starts from the
same noise, so rows differ only by what the model learnt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.data.images import open_image
from lorakit.io import atomic_path
from lorakit.models.base import resolution_mu


@dataclass
class Condition:
    label: str
    text: dict  # batch of 1
    shape: tuple  # latent shape without the batch dimension
    controls: list = field(default_factory=list)  # batch-of-1 control latents (edit)
    uncond: dict | None = None  # the empty caption, for classifier-free guidance
    control_images: list = field(default_factory=list)  # the controls as PIL images (shown beside the sample)


def _batch1(d: dict) -> dict:
    return {k: v.unsqueeze(0) for k, v in d.items() if k in ("prompt_embeds", "pooled")}


def conditions(cfg, adapter, data, limit: int = 4) -> list[Condition]:
    """What to render: `sampling.prompts` (encoded now) or else the captions of the first `limit` items.

    Edit families: prompt k takes the control images `sampling.controls[k]` when given, else those of item k;
    items are the held-out validation items when there are any (an edit the LoRA has not trained on), else the
    training items. Each sample is shown beside the control images it started from."""
    items = data.validation or data.items
    prompts = list(cfg.sampling.prompts or [])
    entries = [data.store.get(it["key"]) for it in items[:max(limit, len(prompts))]]
    n_ctrl = sum(1 for k in entries[0] if k.startswith("control_latents_"))
    empty = data.empty()
    explicit = [[Path(p)] if isinstance(p, (str, Path)) else [Path(x) for x in p] for p in cfg.sampling.controls]

    def parts(j: int):
        e = entries[j % len(entries)]
        controls = [e[f"control_latents_{c}"].unsqueeze(0) for c in range(n_ctrl)]
        un = ({"prompt_embeds": e["empty_prompt_embeds"].unsqueeze(0)} if "empty_prompt_embeds" in e
              else (_batch1(empty) if empty else None))
        return e, controls, un

    def shown(j: int, controls: list) -> list:
        """The control images of item j as given (files), or decoded from their latents if the files are gone."""
        it = items[j % len(items)]
        try:
            return [open_image(Path(c)) for c in it["controls"]]
        except Exception:  # noqa: BLE001 - moved or deleted since caching: show what the model sees
            return [_to_image(adapter.decode_latents(c)[0]) for c in controls]

    out = []
    if prompts:
        size = cfg.sampling.size or cfg.data.resolution
        ctrl_images = None
        if n_ctrl or explicit:
            ctrl_images = [[open_image(p) for p in explicit[j]] if j < len(explicit)
                           else [open_image(Path(c)) for c in items[j % len(items)]["controls"]]
                           for j in range(len(prompts))]
        encoded = adapter.encode_prompts(prompts, controls=ctrl_images)
        for j, (p, enc) in enumerate(zip(prompts, encoded, strict=True)):
            e, controls, un = parts(j)
            images = []
            if ctrl_images is not None:
                images = ctrl_images[j]
                if j < len(explicit):  # this prompt's own controls: encode them (and its empty prompt with them)
                    controls = [c.unsqueeze(0) for c in adapter.encode_controls(images, cfg.data.control_resolution)]
                    if "empty_prompt_embeds" in e:
                        un = _batch1(adapter.encode_prompts([""], controls=[images])[0])
            shape = tuple(e["latents"].shape) if (n_ctrl or e["latents"].dim() == 4) else \
                (e["latents"].shape[0], *adapter.latent_hw(size, size))
            out.append(Condition(p, _batch1(enc), shape, controls, un, images))
    else:
        for j, it in enumerate(items[:limit]):
            e, controls, un = parts(j)
            out.append(Condition(it.get("caption", it["key"]), _batch1(e), tuple(e["latents"].shape), controls, un,
                                 shown(j, controls) if controls else []))
    return out


def _to_image(pix):
    """(3, H, W) in [-1, 1] -> PIL."""
    import numpy as np
    from PIL import Image

    pix = pix.float().nan_to_num(0.0, 1.0, -1.0)  # non-finite pixels are reported by render, drawn mid-grey here
    arr = ((pix.clamp(-1, 1).permute(1, 2, 0).cpu().numpy() + 1) * 127.5).round().astype(np.uint8)
    return Image.fromarray(arr)


def sigma_schedule(steps: int, image_seq_len: int, scheduler_config: dict, mu: float | None = None):
    """The sampling sigmas (steps + 1 values, ending at 0) as the family's flow-matching scheduler sets them
    (`mu`: the dynamic shift the family's pipeline passes it, `Adapter.shift_mu`)."""
    import torch

    s = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    if scheduler_config.get("use_flow_sigmas"):  # UniPC's flow sigmas (Wan): steps + 1 points from 1 to 1/T, the last
        bottom = 1.0 / scheduler_config.get("num_train_timesteps", 1000)  # left out
        s = torch.linspace(1.0, bottom, steps + 1, dtype=torch.float64)[:-1]
    if scheduler_config.get("use_dynamic_shifting"):
        mu = resolution_mu(image_seq_len, scheduler_config) if mu is None else mu
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    else:
        k = float(scheduler_config.get("shift", scheduler_config.get("flow_shift", 1.0)))
        s = k * s / (1 + (k - 1) * s)
    end = scheduler_config.get("shift_terminal")
    if end:  # stretched so that the last sigma before 0 is `shift_terminal` (Qwen-Image's 0.02), as the scheduler does
        s = 1 - (1 - s) * (1 - end) / (1 - s[-1])
    return torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float()


def render(trainer, conds: list[Condition], problems: list | None = None) -> list:
    """One PIL image per condition from the model as it is now (eval mode, no gradients). The transformer runs
    under autocast as training does; the VAE decodes outside it, as the stock pipelines decode. `problems`
    gets one line per sample that came out non-finite, naming where (a black square says nothing)."""
    import torch

    cfg, dev = trainer.cfg, trainer.device
    was = trainer.transformer.training
    trainer.transformer.eval()
    images = []
    vae = trainer.adapter.parts.get(trainer.adapter.vae_part) if cfg.memory.cpu_offload else None
    if vae is not None:  # memory.cpu_offload: the VAE waits on the CPU between grids
        vae.to(dev)
    try:
        for k, c in enumerate(conds):
            x, bad = denoise(trainer, c, k, cfg.sampling.steps)
            pix = decode(trainer, x, problems)
            if bad is None and not torch.isfinite(pix).all():
                bad = f"the VAE decode (latents finite, max |x| {x.abs().max().item():.3g})"
            if bad and problems is not None:
                problems.append(f"sample {k + 1} ({c.label[:40]!r}) is not finite: {bad} produced NaN/inf")
            images.append(_to_image(pix))
    finally:
        trainer.transformer.train(was)
        vae = trainer.adapter.parts.get(trainer.adapter.vae_part) if cfg.memory.cpu_offload else None
        if vae is not None:
            vae.to("cpu")
    return images


def decode(trainer, x, problems: list | None = None):
    """The VAE's decode of one sample's latents: whole, as the stock pipelines decode, unless that does not fit
    beside what training holds; then in tiles (diffusers' `enable_tiling`, a fraction of the memory), for this and
    every later grid, said once in `problems`. On a 24 GiB card the whole decode of Qwen-Image's VAE at 1232x848
    (about 4.1 GiB: `placement.DECODE_GIB_PER_MPX`) beside the rtx4090 profile's 8-bit base ran out of memory
    (one H200 held to 24 GiB with the CUDA context inside it, 2026-11-29): the step-0 grid ended the run."""
    import torch

    adapter = trainer.adapter
    try:
        with torch.no_grad():
            return adapter.decode_latents(x)[0]
    except torch.OutOfMemoryError:
        vae = adapter.parts.get(adapter.vae_part)
        if vae is None or not hasattr(vae, "enable_tiling") or getattr(vae, "use_tiling", False):
            raise
    torch.cuda.empty_cache()  # outside the handler: the failed decode's tensors are gone with its frames
    vae.enable_tiling()
    if problems is not None:
        problems.append("the VAE's whole decode did not fit beside training (out of GPU memory): it decodes in "
                        "tiles from now on (the samples may differ slightly at the tiles' seams)")
    with torch.no_grad():
        return adapter.decode_latents(x)[0]


def denoise(trainer, c: Condition, k: int, steps: int):
    """Condition k's latents after `steps` sampling steps from its seeded noise (no gradients, under autocast as
    training runs), in the transformer's mode as it is; and where they first came out non-finite (None: never)."""
    import torch

    cfg, dev, dt = trainer.cfg, trainer.device, trainer.dtype
    guidance = cfg.sampling.guidance
    embedded = trainer.adapter.guidance == "embedded"
    bad = None
    with torch.no_grad(), torch.autocast(dev.split(":")[0], dtype=dt, enabled=dt != torch.float32):
        g = torch.Generator().manual_seed(cfg.sampling.seed + k)
        x = torch.randn((1, *c.shape), generator=g).to(dev, torch.float32)
        seq = trainer.adapter.image_seq_len(c.shape)
        sig = sigma_schedule(steps, seq, trainer.sched_cfg, trainer.adapter.shift_mu(seq, trainer.sched_cfg, steps))
        text = {k2: v.to(dev, dt) for k2, v in c.text.items()}
        controls = [t.to(dev, dt) for t in c.controls]
        un = {k2: v.to(dev, dt) for k2, v in c.uncond.items()} if c.uncond and guidance > 1 and not embedded \
            else None
        if un is not None and "pooled" in text and "pooled" not in un:
            un["pooled"] = torch.zeros_like(text["pooled"])
        for i, (s, s_next) in enumerate(zip(sig[:-1], sig[1:], strict=True)):
            st = s.view(1).to(dev)
            v = trainer.adapter.predict(trainer.transformer, x.to(dt), st, text,
                                        guidance=guidance if embedded else 1.0, controls=controls).float()
            if un is not None:
                vu = trainer.adapter.predict(trainer.transformer, x.to(dt), st, un, controls=controls).float()
                v = vu + guidance * (v - vu)
            x = x + (float(s_next) - float(s)) * v
            if bad is None and not torch.isfinite(x).all():
                bad = f"the transformer's prediction at sampling step {i + 1} of {len(sig) - 1}"
    return x, bad


def _fit_box(im, w: int, h: int):
    """The image scaled to fit a w x h box (aspect kept; nearest-neighbour when enlarging tiny samples)."""
    from PIL import Image

    scale = min(w / im.width, h / im.height)
    size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
    return im.resize(size, Image.NEAREST if scale > 1 else Image.LANCZOS)


def _labelled_row(images, labels, title: str, cell: int, controls=None):
    """One row of a grid: the title, then per condition its control images (edit: stacked in a column, each
    1/n of the cell high, marked "in") and the sample, labelled with its prompt."""
    from PIL import Image, ImageDraw

    pad, text_h, head = 4, 14, 90
    controls = controls or [[] for _ in images]
    cols = [(cell // len(c) + pad if c else 0) + cell + pad for c in controls]
    row = Image.new("RGB", (head + pad + sum(cols), cell + text_h + 2 * pad), "white")
    d = ImageDraw.Draw(row)
    d.text((pad, pad), title, fill="black")
    x = head + pad
    for im, lab, ctrl, width in zip(images, labels, controls, cols, strict=True):
        sx = x
        if ctrl:
            side = cell // len(ctrl)
            for k, c in enumerate(ctrl):
                row.paste(_fit_box(c, side, side), (x, pad + k * side))
            d.text((x, pad + cell + 1), "in", fill="gray")
            sx = x + side + pad
        row.paste(_fit_box(im, cell, cell), (sx, pad))
        d.text((sx, pad + cell + 1), lab[: max(4, cell // 6)], fill="black")
        x += width
    return row


class Sampler:
    """Renders the fixed conditions and keeps every grid: samples/step-NNNNNN.png, and samples/progress.png
    with one row per render (first row: before training)."""

    def __init__(self, trainer, conds: list[Condition], folder: Path, cell: int = 256, warn=None):
        from PIL import Image

        self.trainer, self.conds, self.folder, self.cell, self.warn = trainer, conds, folder, cell, warn
        self.rows: list = []
        for p in sorted(folder.glob("step-*.png")):  # a resumed run keeps the rows rendered before
            step = int(p.stem.split("-")[1])
            if step <= trainer.step:
                self.rows.append((step, Image.open(p).convert("RGB")))

    def __call__(self, step: int, write: bool = True, name: str | None = None) -> Path | None:
        """Render at `step` (with the EMA weights when EMA is on). `name` (best): samples/NAME-step-N.png,
        outside progress.png."""
        problems: list[str] = []
        with self.trainer.averaged():
            images = render(self.trainer, self.conds, problems)
        for p in problems:
            if self.warn:
                self.warn(f"samples at step {step}: {p}")
        if not write:
            return None

        cell = min(self.cell, max(64, images[0].width * 2))
        row = _labelled_row(images, [c.label for c in self.conds], f"{name or 'step'} {step}", cell,
                            [c.control_images for c in self.conds])
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / (f"{name}-step-{step:06d}.png" if name else f"step-{step:06d}.png")
        with atomic_path(path) as tmp:
            row.save(tmp, format="PNG")
        if name:
            return path
        self.rows = [r for r in self.rows if r[0] != step] + [(step, row)]
        self._progress()
        return path

    def reuse(self, step: int, grid: Path) -> Path:
        """An identical grid rendered before (`train.first_grid`) taken as this step's: samples/step-NNNNNN.png and
        its row in progress.png, as a render would have written them."""
        from PIL import Image

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:06d}.png"
        with atomic_path(path) as tmp:
            tmp.write_bytes(grid.read_bytes())
        self.rows = [r for r in self.rows if r[0] != step] + [(step, Image.open(path).convert("RGB"))]
        self._progress()
        return path

    def _progress(self) -> None:
        from PIL import Image

        rows = [r for _, r in sorted(self.rows, key=lambda x: x[0])]
        grid = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
        y = 0
        for r in rows:
            grid.paste(r, (0, y))
            y += r.height
        with atomic_path(self.folder / "progress.png") as tmp:
            grid.save(tmp, format="PNG")
