"""What a run's datasets give: one entry per thing that is encoded and trained on, and every problem.

An image item is one entry; a clip gives one entry per window (`data.frames / fps / start / windows`); an
edit item records the size each control is encoded at (the family's `control_size`). `lorakit cache --check`
prints this plan, and the cache builder encodes it: both see the same entries and the same problems.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.data.buckets import make_buckets, nearest_bucket
from lorakit.data.dataset import Item, scan
from lorakit.data.video import Sampling, Window
from lorakit.data.video import plan as plan_windows
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info


@dataclass
class Entry:
    item: Item
    bucket: tuple  # (width, height), video: (width, height, frames)
    window: Window | None = None
    control_sizes: list[tuple[int, int]] = field(default_factory=list)  # VAE size of each control (edit)
    dataset: int = 0  # index in cfg.data.all_datasets()

    @property
    def label(self) -> str:
        if self.window is None:
            return self.item.stem
        return f"{self.item.stem}@{self.window.start:g}s/{self.window.frames}f"

    @property
    def group(self) -> tuple:
        """Entries of one group can share a batch: same target bucket, same control sizes."""
        return tuple(self.bucket) + tuple(x for wh in self.control_sizes for x in wh)

    def settings(self) -> dict:
        """What this entry's tensors depend on beyond its files, caption and bucket."""
        out = {}
        if self.window is not None:
            out["window"] = {"start": self.window.start, "indices": list(self.window.indices)}
        if self.control_sizes:
            out["control_sizes"] = [list(s) for s in self.control_sizes]
        return out


@dataclass
class DataPlan:
    layout: str
    entries: list[Entry] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)  # {"path", "code", "message"}
    datasets: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what trains, but not as the user may think (warnings)

    def buckets(self) -> dict[str, int]:
        hist = Counter("x".join(str(x) for x in e.bucket) for e in self.entries)
        return dict(sorted(hist.items(), key=lambda kv: [int(x) for x in kv[0].split("x")]))


def control_dirs_for(cfg, root: Path) -> list[str]:
    """The control folders of a dataset. A family that takes several control images (Edit-Plus), left at the
    default setting, uses every control folder present (control/, control_2/, ...) up to its maximum."""
    dirs = list(cfg.data.control_dirs)
    most = family_adapter(cfg.model.family).max_controls
    if most > 1 and dirs == ["control"] and root.is_dir():
        found = sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("control")),
                       key=lambda n: (len(n), n))
        return found[:most] or dirs
    return dirs


def plan_data(cfg) -> DataPlan:
    """Scan every dataset of a config and cut its items into entries (no model needed)."""
    facts = family_adapter(cfg.model.family)
    layout = facts.layout
    buckets = make_buckets(cfg.data.resolution, family_info(cfg.model.family).patch, cfg.data.bucket_min_side,
                           cfg.data.bucket_max_side)
    sampling = Sampling(cfg.data.frame_counts, cfg.data.fps, cfg.data.start, cfg.data.windows)
    out = DataPlan(layout)
    for ds_index, ds in enumerate(cfg.data.all_datasets()):
        root = Path(ds.dir)
        controls = control_dirs_for(cfg, root) if root.is_dir() else cfg.data.control_dirs
        s = scan(root, layout=layout, control_dirs=controls, caption_ext=cfg.data.caption_ext,
                 min_side=cfg.data.bucket_min_side, trigger=ds.trigger, alpha_mask=cfg.data.alpha_mask,
                 default_caption=cfg.data.default_caption)
        out.problems += [p.__dict__ for p in s.problems]
        if s.uncaptioned:
            out.notes.append(f"{len(s.uncaptioned)} item(s) in {root} have no caption file and train with "
                             f"data.default_caption (e.g. {s.uncaptioned[0]})")
        before, problems_before = len(out.entries), len(out.problems) - len(s.problems)
        for it in s.items:
            if it.size is None:
                continue
            bucket = nearest_bucket(it.size, buckets)
            if it.clip is not None:  # a clip: one entry per window
                p = plan_windows(it.clip, sampling)
                out.problems += [{"path": str(it.target), "code": c, "message": m} for c, m in p.problems]
                out.entries += [Entry(it, (*bucket, w.frames), w, dataset=ds_index) for w in p.windows]
            elif it.controls:  # an edit: each control at the size the family encodes it
                sizes = [facts.control_size(w, h, cfg.data.control_resolution) for w, h in it.control_sizes]
                out.entries.append(Entry(it, bucket, control_sizes=sizes, dataset=ds_index))
            else:
                out.entries.append(Entry(it, bucket, dataset=ds_index))
        out.datasets.append({"dir": str(root), "role": ds.role, "weight": ds.weight, "layout": s.layout,
                             "items": len(s.items),
                             "entries": len(out.entries) - before, "problems": len(out.problems) - problems_before,
                             "controls": controls if s.layout == "edit" else []})
    out.notes += collapsed_buckets(out.entries, cfg, len(buckets)) + empty_masks(out.entries)
    return out


SQUEEZED = 1.25  # an image whose aspect ratio is this far from its bucket's is cropped hard


def collapsed_buckets(entries: list[Entry], cfg, n_buckets: int) -> list[str]:
    """Images cut to a much different shape because the buckets cannot hold their aspect ratio (e.g. resolution
    256 with bucket_min_side 256: one square bucket for every image)."""
    bad = []
    for e in entries:
        if e.window is not None or not e.item.size:
            continue
        (w, h), (bw, bh) = e.item.size, e.bucket[:2]
        ratio = (w / h) / (bw / bh)
        if max(ratio, 1 / ratio) > SQUEEZED:
            bad.append(e)
    if not bad:
        return []
    e = bad[0]
    return [f"{len(bad)} of {len(entries)} images are cropped to a much different shape (e.g. {e.item.target.name} "
            f"{e.item.size[0]}x{e.item.size[1]} -> {e.bucket[0]}x{e.bucket[1]}): at resolution "
            f"{cfg.data.resolution} with bucket_min_side {cfg.data.bucket_min_side} there are {n_buckets} bucket "
            f"shape(s); a smaller data.bucket_min_side (e.g. {max(cfg.data.resolution // 2, 64)}) keeps their "
            "aspect ratios"]


def empty_masks(entries: list[Entry]) -> list[str]:
    """Loss masks that mask everything: their items train nothing (loss 0)."""
    from PIL import Image

    empty = []
    for e in {id(x.item): x for x in entries if x.item.mask is not None}.values():
        try:
            with Image.open(e.item.mask) as im:
                band = im.getchannel("A") if e.item.mask_alpha and "A" in im.getbands() else im.convert("L")
                if band.getextrema()[1] == 0:
                    empty.append(e.item.mask)
        except OSError:
            continue  # an unreadable mask is a problem the scan reports
    if not empty:
        return []
    return [f"{len(empty)} loss mask(s) are black everywhere, so their items train nothing (loss 0), e.g. "
            f"{empty[0]} (white trains, black is ignored)"]
