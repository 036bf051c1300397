"""The `data` section: dataset folders, buckets, captions, masks, video windows, edit controls."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lorakit.config.base import Text, _Section, _suggest_multiple


class DatasetConfig(_Section):
    dir: Path = Field(description="the dataset folder")
    weight: float = Field(1.0, gt=0, description="how often its items are seen relative to the others: each item "
                                                 "weight x repeats times per epoch (fractions: that share of epochs)")
    repeats: int | None = Field(None, ge=1, description="times each item is seen per epoch (default: data.repeats)")
    role: Literal["train", "prior"] = Field("train", description="prior: class images for prior preservation "
                                                                 "(mixed in at data.prior_ratio)")
    loss_weight: float = Field(1.0, ge=0, description="its items' loss is multiplied by this (e.g. a prior "
                                                      "dataset's prior-preservation weight)")
    trigger: Text | None = Field(None, description="text put before its captions (default: data.trigger)")


class DataConfig(_Section):
    dirs: list[Path] = Field(default_factory=list, description="dataset folders (images + .txt captions), each "
                                                               "with the defaults below")
    datasets: list[DatasetConfig] = Field(default_factory=list, description="dataset folders with their own "
                                          "weight, repeats, role (train | prior), loss_weight and trigger; "
                                          "used beside data.dirs")
    prior_ratio: float | None = Field(None, gt=0, description="prior datasets are seen this many times per training "
                                                              "item seen (their weights then share that out)")
    resolution: int = Field(1024, description="training resolution: buckets hold about resolution² pixels")
    buckets: bool = Field(True, description="aspect-ratio buckets (False: center-crop to a square)")
    bucket_min_side: int = Field(256, description="smallest bucket side in pixels")
    bucket_max_side: int = Field(2048, description="largest bucket side in pixels")
    caption_ext: str = Field(".txt", description="caption file extension")
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0, description="probability of training with an empty caption")
    trigger: Text | None = Field(None, description="text put before every caption (e.g. a trigger word)")
    default_caption: Text | None = Field(None, description="the caption of an image or clip without a caption "
                                                           "file (the trigger before it; \"\" with a trigger: the "
                                                           "trigger alone); default: such items are skipped, named")
    alpha_mask: bool = Field(False, description="image families: each image's alpha channel is its loss mask "
                                                "(opaque trains, transparent is ignored); a masks/ folder, where "
                                                "there is one, comes first")
    caption_shuffle: bool = Field(False, description="shuffle comma-separated caption tags: each item is cached "
                                                     "with caption_variants orderings (the first keep_tokens tags "
                                                     "stay first) and a step trains on one of them")
    keep_tokens: int = Field(1, ge=0, description="caption_shuffle: tags kept in place at the start (the trigger "
                                                  "word is part of the first)")
    caption_variants: int = Field(4, ge=2, le=32, description="caption_shuffle: orderings cached per item (the "
                                                              "caption as written is the first)")
    repeats: int = Field(1, ge=1, description="times each item is seen per epoch")
    control_dirs: list[str] = Field(default_factory=lambda: ["control"],
                                    description="edit families: control image folders beside images/")
    frames: int | list[int] = Field(17, description="video families: frames per training clip, one count or a "
                                                    "list (frame buckets: each count gives its own windows; "
                                                    "the family's rule, e.g. 4k+1)")
    fps: float | None = Field(None, gt=0, description="video families: frames per second sampled from clips "
                                                     "(default: each clip's own rate)")
    start: float = Field(0.0, ge=0, description="video families: seconds skipped at the start of every clip")
    windows: int = Field(1, ge=1, description="video families: windows per clip and frame count, spread evenly "
                                              "over the clip")
    control_resolution: int | None = Field(None, description="edit families: control images at about this many "
                                                             "pixels squared, at their own aspect ratio (default: "
                                                             "the stock pipeline's rule, 1024² for Qwen-Image-Edit "
                                                             "and Kontext)")
    cache_dir: Path | None = Field(None, description="where `lorakit cache` stores embeddings and latents "
                                                     "(default: <output.dir>/cache)")

    @field_validator("dirs", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, (str, Path)) else v

    def all_datasets(self) -> list[DatasetConfig]:
        """Every dataset: data.dirs (with the defaults), then data.datasets; repeats and trigger filled in."""
        out = [DatasetConfig(dir=d) for d in self.dirs] + [d.model_copy() for d in self.datasets]
        for d in out:
            d.repeats = d.repeats or self.repeats
            d.trigger = d.trigger if d.trigger is not None else self.trigger
        return out

    @field_validator("resolution", "bucket_min_side", "bucket_max_side")
    @classmethod
    def _multiple_of_16(cls, v: int) -> int:
        if v < 16:
            raise ValueError("must be at least 16")
        if v % 16:
            raise ValueError(f"must be a multiple of 16 (try {_suggest_multiple(v, 16)})")
        return v

    @field_validator("frames")
    @classmethod
    def _frame_counts(cls, v: Any) -> Any:
        counts = [v] if isinstance(v, int) else v
        if not counts:
            raise ValueError("give at least one frame count")
        if any(n < 1 for n in counts):
            raise ValueError("frame counts must be at least 1")
        return v

    @field_validator("control_resolution")
    @classmethod
    def _control_res(cls, v: int | None) -> int | None:
        if v is not None and (v < 64 or v % 16):
            raise ValueError("must be a multiple of 16, at least 64")
        return v

    @property
    def frame_counts(self) -> tuple[int, ...]:
        """The frame counts, ascending."""
        return tuple(sorted({self.frames} if isinstance(self.frames, int) else set(self.frames)))

    @field_validator("caption_ext")
    @classmethod
    def _dot(cls, v: str) -> str:
        return v if v.startswith(".") else "." + v

    @model_validator(mode="after")
    def _prior(self) -> DataConfig:
        roles = {d.role for d in self.datasets}
        if self.prior_ratio is not None and "prior" not in roles:
            raise ValueError("prior_ratio is set but no dataset has role: prior")
        if roles == {"prior"} and not self.dirs:
            raise ValueError("every dataset has role: prior; give a training dataset too")
        return self

    @model_validator(mode="after")
    def _sides(self) -> DataConfig:
        if self.bucket_min_side > self.bucket_max_side:
            raise ValueError(f"bucket_min_side ({self.bucket_min_side}) is larger than bucket_max_side "
                             f"({self.bucket_max_side})")
        return self
