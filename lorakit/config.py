"""The typed config tree and how it is assembled.

Precedence (lowest first): built-in defaults < profile < the user's YAML < `--set key=value`.
Every problem is collected and reported at once, each with its key path and the value received.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorakit.errors import ConfigError
from lorakit.models.registry import family_info, family_names


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _suggest_multiple(value: int, m: int) -> str:
    lo, hi = (value // m) * m, (value // m + 1) * m
    opts = [str(x) for x in (hi, lo) if x > 0]
    return " or ".join(opts)


class ModelConfig(_Section):
    family: str = Field(description="model family: " + ", ".join(family_names()))
    path: Path | None = Field(None, description="the diffusers model folder (model_index.json inside), as downloaded from the hub")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="compute dtype of the trainable model")

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in family_names():
            close = difflib.get_close_matches(v, family_names(), n=1)
            tip = f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(family_names())})"
            raise ValueError(f"unknown family{tip}")
        return v


class DatasetConfig(_Section):
    dir: Path = Field(description="the dataset folder")
    weight: float = Field(1.0, gt=0, description="how often its items are seen relative to the others: each item "
                                                 "weight x repeats times per epoch (fractions: that share of epochs)")
    repeats: int | None = Field(None, ge=1, description="times each item is seen per epoch (default: data.repeats)")
    role: Literal["train", "prior"] = Field("train", description="prior: class images for prior preservation "
                                                                 "(mixed in at data.prior_ratio)")
    loss_weight: float = Field(1.0, ge=0, description="its items' loss is multiplied by this (e.g. a prior "
                                                      "dataset's prior-preservation weight)")
    trigger: str | None = Field(None, description="text put before its captions (default: data.trigger)")


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
    trigger: str | None = Field(None, description="text put before every caption (e.g. a trigger word)")
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

    def sampling(self):
        """How clips are cut into training windows (`lorakit.data.video.Sampling`)."""
        from lorakit.data.video import Sampling

        return Sampling(self.frame_counts, self.fps, self.start, self.windows)

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


TargetPreset = Literal["attention", "attention_mlp", "all_linear"]


class LoraConfig(_Section):
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (default: equal to rank, i.e. scale 1)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    targets: TargetPreset | list[str] = Field(
        "attention", description="a preset (attention, attention_mlp, all_linear) or a list of module names")
    init: Literal["default", "gaussian"] = Field("default", description="LoRA weight initialisation")
    dora: bool = Field(False, description="train DoRA (weight-decomposed LoRA); the same as type: dora")
    type: Literal["lora", "dora", "lokr", "loha"] = Field(
        "lora", description="adapter: lora; dora; lokr (LyCORIS Kronecker product: rank = the rank of its "
                            "factored factor); loha (LyCORIS Hadamard product of two rank-r products). peft "
                            "trains all four; LoKr/LoHa files use LyCORIS key names (ComfyUI, lorakit infer, peft)")
    factor: int = Field(-1, description="lokr: the Kronecker factor of each dimension (-1: as balanced as the "
                                        "dimension allows)")
    train_io: bool = Field(False, description="also put LoRA on the layers between latents and blocks (patch "
                                              "embedder, final norm modulation, output projection)")

    @field_validator("targets")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("an empty module list trains nothing")
        return v

    @model_validator(mode="after")
    def _kind(self) -> LoraConfig:
        if self.dora and self.type not in ("lora", "dora"):
            raise ValueError(f"dora: true with type: {self.type} (DoRA is a kind of LoRA; pick one)")
        if self.dora:
            object.__setattr__(self, "type", "dora")
        if self.factor != -1 and self.type != "lokr":
            raise ValueError(f"factor is a LoKr setting (type: {self.type})")
        return self

    @property
    def is_dora(self) -> bool:
        return self.type == "dora"


class OptimConfig(_Section):
    name: Literal["adamw", "adamw8bit", "prodigy", "adafactor"] = Field("adamw", description="optimizer")
    lr: float = Field(1e-4, gt=0, description="peak learning rate (Prodigy: 1.0)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping norm (null: off)")


class ScheduleConfig(_Section):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    batch_size: int = Field(1, ge=1, description="items per micro-batch (per GPU)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    timesteps: Literal["uniform", "logit_normal", "shift", "resolution_shift", "sigmoid", "mode"] = Field(
        "resolution_shift", description="how training sigmas are drawn: uniform; logit_normal (logit_mean, "
                                        "logit_std); shift (shift); resolution_shift (the family scheduler's own "
                                        "shift for the image's token count); sigmoid (sigmoid(timestep_scale * "
                                        "N(0,1))); mode (SD3's mode sampling, timestep_scale in [-1, 1.75])")
    shift: float = Field(3.0, gt=0, description="sigma shift for timesteps=shift")
    logit_mean: float = Field(0.0, description="logit-normal mean")
    logit_std: float = Field(1.0, gt=0, description="logit-normal std")
    timestep_scale: float | None = Field(None, description="scale of timesteps=sigmoid (default 1.0) or "
                                                           "timesteps=mode (default 1.29)")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = Field("none", description="per-sigma loss weight")

    @model_validator(mode="after")
    def _scale(self) -> ScheduleConfig:
        import math

        if self.timestep_scale is not None and self.timesteps not in ("sigmoid", "mode"):
            raise ValueError(f"timestep_scale is used by timesteps=sigmoid or mode, not {self.timesteps}")
        if self.timesteps == "mode" and not -1 <= self.scale <= 2 / (math.pi - 2):
            raise ValueError(f"timestep_scale {self.scale:g}: mode sampling needs -1 <= scale <= "
                             f"{2 / (math.pi - 2):.3f} (outside, sigmas leave (0, 1))")
        if self.timesteps == "sigmoid" and self.scale <= 0:
            raise ValueError(f"timestep_scale {self.scale:g}: sigmoid sampling needs a positive scale")
        return self

    @property
    def scale(self) -> float:
        """timestep_scale, or the sampler's usual default (sigmoid 1.0; mode 1.29, diffusers' SD3 choice)."""
        if self.timestep_scale is not None:
            return self.timestep_scale
        return 1.29 if self.timesteps == "mode" else 1.0

    @model_validator(mode="after")
    def _warmup(self) -> ScheduleConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        return self


class MemoryConfig(_Section):
    """Filled by the hardware profile; override only when you know the machine better."""

    base_quant: Literal["none", "fp8", "qfloat8", "nf4"] = Field(
        "none", description="storage of the frozen base transformer (none: model.dtype)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")
    checkpoint_blocks: int | Literal["all", "auto"] = Field(
        "auto", description="with gradient_checkpointing: which repeated blocks recompute — auto: the fewest with "
                            "which the memory estimate fits the GPU less 1.5 GiB (it may also turn checkpointing "
                            "off; block swapping and multi-GPU runs recompute all), all, or the first N in "
                            "execution order")

    @field_validator("checkpoint_blocks")
    @classmethod
    def _blocks_not_negative(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError(f"must be all, auto or a block count >= 0, got {v}")
        return v
    blocks_to_swap: int = Field(0, ge=0, description="transformer blocks kept on the CPU and swapped in")
    cpu_offload: bool = Field(False, description="keep idle components on the CPU (the VAE between sample grids; "
                                                 "text encoders are freed after caching in any case)")
    pin_memory: bool = Field(True, description="page-locked host buffers (off on unified memory)")
    expandable_segments: bool = Field(False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    unified_memory: bool = Field(False, description="CPU and GPU share memory (DGX Spark)")
    cache_in_memory: bool = Field(False, description="keep the latent/text cache in memory")
    free_encoders_after_cache: bool = Field(True, description="free text encoders and VAE once cached")
    compile: bool = Field(False, description="torch.compile the repeated transformer blocks")
    cuda_graphs: bool = Field(False, description="with compile: replay each compiled block as a CUDA graph "
                                                 "(less host time per block; not while blocks recompute for "
                                                 "gradient checkpointing, nor with schedule.grad_accum > 1)")
    compute: Literal["bf16", "fp8"] = Field(
        "bf16", description="matmuls of the frozen base's block Linears: bf16, or fp8 (opt-in; e4m3 inputs and "
                            "weights scaled per token / per row, GPUs of compute capability 8.9+; LoRA stays bf16)")
    attention: Literal["auto", "flash", "efficient", "cudnn", "math", "flash+efficient", "fa4",
                       "fa4+efficient"] = Field(
        "auto", description="SDPA backend (auto: doctor's self-test; flash+efficient: flash for unmasked "
                            "batches, efficient for masked; fa4: SDPA's flash path through the flash-attn-4 "
                            "package's kernels, Hopper/Blackwell, opt-in)")
    loader: Literal["auto", "safetensors", "fastsafetensors", "lorakit"] = Field(
        "auto", description="weight loading backend")
    optimizer_8bit: bool = Field(False, description="8-bit optimizer states (bitsandbytes)")


class SamplingConfig(_Section):
    enabled: bool = Field(True, description="render sample grids during training (samples/)")
    every: int = Field(0, ge=0, description="sample every N steps (0: only before and after)")
    prompts: list[str] = Field(default_factory=list, description="sample prompts (default: the captions of the "
                                                                 "first 4 items); edit families pair prompt k "
                                                                 "with item k's control images (items: the "
                                                                 "held-out validation items if any, else the "
                                                                 "training items); samples are shown beside "
                                                                 "their controls")
    controls: list[Path | list[Path]] = Field(default_factory=list, description="edit families: control images "
                                              "for the prompts, in order (a path, or a list of paths for several "
                                              "controls); prompts without one take item k's")
    steps: int = Field(20, ge=1, description="inference steps per sample")
    guidance: float = Field(3.5, ge=0, description="FLUX guidance / Qwen true-CFG scale")
    seed: int = Field(42, description="sampling seed")
    size: int | None = Field(None, description="sample side in pixels (default: data.resolution)")


class LoggingConfig(_Section):
    wandb: bool = Field(False, description="also log metrics, the config and sample grids to Weights & Biases "
                                           "(pip install 'lorakit[wandb]'); WANDB_MODE=offline works without "
                                           "a network (wandb sync later)")
    wandb_project: str = Field("lorakit", description="W&B project")
    wandb_run_name: str | None = Field(None, description="W&B run name (default: output.name and the time)")
    wandb_mode: Literal["online", "offline"] | None = Field(None, description="W&B mode (default: WANDB_MODE, "
                                                                             "else online)")


class EmaConfig(_Section):
    enabled: bool = Field(False, description="keep an exponential moving average of the trained LoRA weights; "
                                             "samples, checkpoints' LoRA files and the final LoRA use it")
    decay: float = Field(0.999, gt=0, lt=1, description="ema = decay * ema + (1 - decay) * weights, each step")
    start_step: int = Field(0, ge=0, description="the average follows the weights exactly up to this step")
    device: Literal["auto", "gpu", "cpu"] = Field("auto", description="where the average lives (auto: the "
                                                                     "profile's choice, else the training device)")


class ValidationConfig(_Section):
    items: int = Field(0, ge=0, description="items held out of training; their loss at fixed sigmas and noise "
                                            "is logged as val_loss")
    every: int = Field(0, ge=0, description="val_loss every N steps (0: at the end only)")
    best: bool = Field(True, description="keep checkpoints/best: the step with the lowest val_loss, with its "
                                         "samples (needs items > 0)")
    patience: int = Field(0, ge=0, description="stop early after this many val_loss checks without a new best "
                                               "(0: never); the final LoRA is then the best step's")
    min_delta: float = Field(0.0, ge=0, description="an improvement smaller than this does not count as a new best")


class OutputConfig(_Section):
    dir: Path = Field(Path("output"), description="where checkpoints, samples and metrics go")
    name: str = Field("lora", description="file name stem of the LoRA")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_last: int = Field(3, ge=1, description="checkpoints kept")


class Config(_Section):
    """The whole run."""

    profile: str = Field("auto", description="hardware profile (auto: chosen from the probe)")
    seed: int = Field(0, description="global seed")
    method: Literal["lora", "full"] = Field(
        "lora", description="lora: train a LoRA on the frozen base; full: train every weight (FSDP on several GPUs)")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)

    @model_validator(mode="after")
    def _family_constraints(self) -> Config:
        info = family_info(self.model.family)
        problems = []
        if self.data.resolution % info.patch:
            problems.append(f"data.resolution must be a multiple of {info.patch} for {info.name}")
        from lorakit.models.base import family_adapter

        facts = family_adapter(self.model.family)
        t = facts.temporal or 1
        if facts.layout == "video" and t > 1:
            bad = [n for n in self.data.frame_counts if (n - 1) % t]
            if bad:
                fix = ", ".join(f"{n} -> {(n - 1) // t * t + 1} or {((n - 1) // t + 1) * t + 1}" for n in bad)
                problems.append(f"data.frames: {info.name} takes {t}k+1 frames (its VAE packs {t} frames into "
                                f"one latent frame after the first); got {bad} ({fix})")
        sc = self.sampling.controls
        if sc and not facts.max_controls:
            problems.append(f"sampling.controls: {info.name} takes no control images")
        elif sc:
            if len(sc) > len(self.sampling.prompts):
                problems.append(f"sampling.controls: {len(sc)} given for {len(self.sampling.prompts)} "
                                "sampling.prompts (one per prompt, in order)")
            for k, c in enumerate(sc):
                n = 1 if isinstance(c, Path) else len(c)
                if not 1 <= n <= facts.max_controls:
                    problems.append(f"sampling.controls[{k}]: {n} images; {info.name} takes 1 to "
                                    f"{facts.max_controls}")
        m = self.memory
        if self.method == "full" and m.blocks_to_swap:
            problems.append(f"memory.blocks_to_swap={m.blocks_to_swap} keeps frozen weights on the host, but "
                            "method=full trains every weight (--set memory.blocks_to_swap=0, or --gpus N: FSDP)")
        if self.method == "full" and m.base_quant != "none":
            problems.append(f"memory.base_quant={m.base_quant} stores a frozen 8/4-bit base, but method=full "
                            "trains every weight (--set memory.base_quant=none)")
        if m.compute == "fp8" and self.method == "full":
            problems.append("memory.compute=fp8 multiplies a frozen base in 8 bits, but method=full trains every "
                            "weight (--set memory.compute=bf16)")
        if m.compute == "fp8" and m.base_quant == "nf4":
            problems.append("memory.compute=fp8 takes a bf16 or 8-bit base, not nf4 (--set memory.base_quant=fp8)")
        if m.base_quant == "nf4" and m.blocks_to_swap:
            problems.append("memory.base_quant=nf4 with memory.blocks_to_swap is not supported (the 4-bit weights "
                            "keep their quantization state on the GPU): use base_quant=fp8 with block swapping, "
                            "or nf4 without it")
        if self.ema.enabled and self.method == "full":
            problems.append("ema.enabled with method=full: an average of every weight is another copy of the model; "
                            "EMA is for LoRA runs (--set ema.enabled=false)")
        v = self.validation
        if (v.patience or v.every) and not v.items:
            problems.append(f"validation.{'patience' if v.patience else 'every'} needs held-out items "
                            "(--set validation.items=N)")
        if problems:
            raise ValueError("\n".join(problems))  # one problem per line (see _format_error)
        return self

    def to_dict(self) -> dict:
        """Plain JSON/YAML-able dict (paths as strings)."""
        return self.model_dump(mode="json")


# --------------------------------------------------------------------------- assembling


def deep_merge(base: dict, over: dict) -> dict:
    """Merge `over` into a copy of `base`; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would silently keep the last)."""


def _strict_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}): which one is meant?",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def parse_yaml(text: str, source: str) -> object:
    """YAML text -> data, duplicate keys refused; errors name the line.

    Raises:
        ConfigError: a syntax error or a duplicate key.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"YAML error{where}: {getattr(e, 'problem', None) or e}"], source=source,
                          hint="YAML wants `key: value` with a space after the colon, nesting by indentation "
                               "(spaces, not tabs), and each key once per section") from None


def load_yaml(path: Path) -> dict:
    """Read a YAML mapping.

    Raises:
        ConfigError: missing file, a folder, not UTF-8, YAML syntax error or duplicate key, or not a mapping.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"{path} is a folder, not a config file"],
                          hint="give the YAML file, e.g. my-run.yaml (`lorakit demo` writes an example config.yaml)")
    if not path.is_file():
        why = "file not found" if not path.exists() else "not a regular file"
        raise ConfigError([f"{why}: {path}"], hint="check the path, or run `lorakit demo` for an example")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path} is not UTF-8 text (byte {e.start} cannot be read)"],
                          hint="save the config as UTF-8") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {type(data).__name__}"],
                          source=str(path))
    return data


_SCI = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_overrides(items: list[str]) -> tuple[dict, list[str]]:
    """Turn `a.b=c` strings into a nested dict; values are parsed as YAML (numbers, lists, null).

    Returns:
        (overrides, problems) — problems are reported together with validation errors.
    """
    out: dict = {}
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"--set {item!r}: expected key.path=value, e.g. --set lora.rank=32")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _SCI.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 2e-4 as a string
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                problems.append(f"--set {item!r}: {p} was already set to a value")
                break
            node = nxt
        else:
            node[parts[-1]] = value
    return out, problems


def _fields_at(loc: tuple) -> list[str]:
    """Field names valid at a location in the tree (for 'did you mean')."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


MOVED = {"sampling.validation_items": "validation.items", "sampling.validation_every": "validation.every"}


def _format_error(err: dict) -> str:
    loc = tuple(str(p) for p in err["loc"])
    path = ".".join(loc) or "(top level)"
    kind = err["type"]
    if not loc and kind == "value_error":  # checks across sections: each line names its keys
        return err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden" and path in MOVED:
        return f"{path}: moved to {MOVED[path]}"
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        tip = f" (did you mean {close[0]!r}?)" if close else (f" (valid: {', '.join(valid)})" if valid else "")
        return f"{path}: unknown key{tip}"
    if kind == "missing":
        return f"{path}: required but missing"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    got = err.get("input")
    if isinstance(got, dict):
        return f"{path}: {msg}"
    return f"{path}: {msg}, got {got!r}"


def validate(data: dict, source: str | None = None, extra_problems: list[str] | None = None) -> Config:
    """Validate a merged dict; all problems (plus `extra_problems`) go into one ConfigError."""
    problems = list(extra_problems or [])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        problems += [line for err in e.errors() for line in _format_error(err).split("\n")]
        cfg = None
    if problems:
        raise ConfigError(problems, source=source,
                          hint="see `docs/configuration.md`; `lorakit train CONFIG --dry-run` checks a config")
    return cfg


def resolve(config_path: Path | None = None, overrides: list[str] | None = None,
            profile: str | None = None, probe_facts: Any = None) -> tuple[Config, dict]:
    """Build the run's config: defaults < profile < YAML < --set.

    Args:
        config_path: the user's YAML (optional).
        overrides: `key.path=value` strings.
        profile: a profile name or "auto"; beats `profile:` in the YAML.
        probe_facts: hardware facts for `auto` (probed when None).

    Returns:
        (config, provenance) where provenance says which profile was used and why.
    """
    from lorakit.hardware import profiles as prof

    user = load_yaml(config_path) if config_path else {}
    sets, problems = parse_overrides(overrides or [])
    layered = deep_merge(user, sets)
    name = profile or layered.get("profile") or "auto"
    if not isinstance(name, str):
        problems.append(f"profile: must be a profile name, got {name!r}")
        name = "auto"
    source = str(config_path) if config_path else None
    # The user's own layer is checked first: its mistakes are reported without probing the machine
    # (which imports torch). Profiles only supply defaults, so they cannot mend a user mistake.
    validate({k: v for k, v in layered.items() if k != "profile"}, source=source, extra_problems=problems)
    choice = prof.choose(name, probe_facts)
    merged = deep_merge(choice.profile.defaults, layered)
    merged["profile"] = choice.profile.name
    cfg = validate(merged, source=source)
    return cfg, {"profile": choice.profile.name, "reason": choice.reason, "warnings": choice.warnings}


def torch_dtype(name: str):
    """bf16 | fp16 | fp32 -> the torch dtype (the names configs and command options use)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _writable_dir_problem(key: str, path: Path) -> str | None:
    import os

    if path.exists() and not path.is_dir():
        return f"{key}: {path} is a file, not a folder"
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not os.access(p, os.W_OK | os.X_OK):
        return f"{key}: cannot create or write {path} (no write permission on {p})"
    return None


def check_paths(cfg: Config, model: bool = True, data: bool = True) -> None:
    """Every path problem of a run at once: the model folder, each dataset folder, the output and cache folders.

    Raises:
        ConfigError: listing them all.
    """
    problems = []
    if model:
        mp = cfg.model.path
        if mp is None:
            problems.append("model.path: required (the diffusers model folder)")
        elif not mp.exists():
            problems.append(f"model.path: no such folder: {mp}")
        elif not mp.is_dir():
            problems.append(f"model.path: {mp} is a file; lorakit takes the diffusers model folder "
                            "(model_index.json inside), as downloaded from the hub")
        elif not (mp / "model_index.json").is_file():
            problems.append(f"model.path: {mp} has no model_index.json (not a diffusers pipeline folder)")
    if data:
        if not cfg.data.dirs and not cfg.data.datasets:
            problems.append("data.dirs: no dataset folder given")
        named = [("data.dirs", d) for d in cfg.data.dirs] + \
                [(f"data.datasets[{k}].dir", d.dir) for k, d in enumerate(cfg.data.datasets)]
        for key, d in named:
            if not d.exists():
                problems.append(f"{key}: no such folder: {d}")
            elif not d.is_dir():
                problems.append(f"{key}: {d} is a file, not a dataset folder")
        for k, c in enumerate(cfg.sampling.controls if cfg.sampling.enabled else ()):
            for p in [c] if isinstance(c, Path) else c:
                if not p.is_file():
                    problems.append(f"sampling.controls[{k}]: no such image file: {p}")
    for key, path in (("output.dir", cfg.output.dir), ("data.cache_dir", cfg.data.cache_dir)):
        why = _writable_dir_problem(key, Path(path)) if path is not None else None
        if why:
            problems.append(why)
    if problems:
        raise ConfigError(problems, hint="fix the paths (all are listed); --set model.path=... data.dirs=[...]")


def device_and_dtype(cfg: Config):
    """(device, torch dtype) a run computes on: the GPU unless the profile is `cpu` or none is visible."""
    import torch

    device = "cuda" if (cfg.profile != "cpu" and torch.cuda.is_available()) else "cpu"
    from lorakit.train.memory import apply_cap

    apply_cap(device)  # LORAKIT_MEMORY_CAP_GIB: a smaller card, emulated
    return device, torch_dtype(cfg.model.dtype)


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what --dry-run prints and what runs save)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
