"""The typed config tree (pydantic v2, extra="forbid"): every section, and the checks across sections against the
family's facts. Every field carries its description: `docs/configuration.md` and `--help` come from here."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lorakit.config.base import Text, _Section
from lorakit.config.data import DataConfig, DatasetConfig
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info, family_names

__all__ = ["Config", "DataConfig", "DatasetConfig"]


class ModelConfig(_Section):
    family: str = Field(description="model family: " + ", ".join(family_names()))
    path: Path | None = Field(None, description="the diffusers model folder (model_index.json inside), a Hugging "
                                                "Face repo id (org/name[@revision]) taken from the hub's cache "
                                                "(downloaded when online; HF_HUB_OFFLINE=1 is honoured), or a "
                                                "single-file checkpoint (.safetensors: FLUX.1's flux1-dev, ComfyUI's "
                                                "diffusion-model files) with model.base")
    base: str | None = Field(None, description="with a single-file model.path: the model it was made from (folder "
                                               "or repo id), whose text encoders, VAE and scheduler go with it "
                                               "(its transformer is not downloaded)")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="compute dtype of the trainable model")
    expert: Literal["high", "low", "both"] | None = Field(
        None, description="Wan 2.2 A14B: the expert the LoRA is for — high (transformer: the high-noise steps, "
                          "layout and motion) or low (transformer_2: the low-noise steps, details; the default); "
                          "sigmas are drawn in that expert's range only. both: `lorakit train` trains high, then "
                          "low, schedule.steps each, into output.dir/high and output.dir/low (one LoRA file each, "
                          "one cache; --resume continues the unfinished one). Other families: leave it out")

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in family_names():
            close = difflib.get_close_matches(v, family_names(), n=1)
            tip = f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(family_names())})"
            raise ValueError(f"unknown family{tip}")
        return v

    @model_validator(mode="after")
    def _expert(self) -> ModelConfig:
        if self.expert is not None and not family_adapter(self.family).experts:
            raise ValueError(f"expert: {self.family} has one transformer, no experts (leave model.expert out)")
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
    reschedule_on_resume: bool = Field(False, description="a resume whose schedule (steps, lr_schedule, "
                                                           "warmup_steps, optim.lr) would change the learning rate "
                                                           "follows the new schedule from the checkpoint's step "
                                                           "(default: refused, naming the change)")
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
    gathered_blocks: int | Literal["auto"] = Field(
        "auto", description="a full fine-tune on several GPUs (FSDP): how many repeated blocks, the last in "
                            "execution order, keep their gathered weights from forward to backward instead of "
                            "gathering them again (one all-gather less per block and step, a block's full weights "
                            "held) — auto: as many as the memory estimate fits in 85% of the GPU")

    @field_validator("checkpoint_blocks", "gathered_blocks")
    @classmethod
    def _block_count_not_negative(cls, v, info):
        if isinstance(v, int) and v < 0:
            words = "all, auto" if info.field_name == "checkpoint_blocks" else "auto"
            raise ValueError(f"must be {words} or a block count >= 0, got {v}")
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
    compile_shapes: Literal["static", "dynamic"] = Field(
        "static", description="static: the sizes that vary over the run's data (bucket shapes, text lengths) are "
                              "symbolic from the first compile, the others fixed (Qwen-Image 24 GiB, 3 buckets: the "
                              "other shapes' compile 90.2 -> 2.4 s); dynamic: every size symbolic from the start "
                              "(measured slower to compile: FLUX 1024² on an H100, 174 s for step 1 against ~52 s)")
    compile_background: bool | Literal["auto"] = Field(
        "auto", description="with compile: the first steps run the blocks uncompiled while a worker thread "
                            "compiles them for the shapes they meet (on a first run with these settings on the "
                            "machine, from what a separate process compiled into the compile cache meanwhile: "
                            "LORAKIT_PRECOMPILE=0 leaves it to the thread), so step 1 does not wait for the compiler "
                            "(those steps are slower; a shape met after the compiled blocks came into use compiles "
                            "as with off); auto: on where the memory plan saved nothing (no 8-bit base, recompute "
                            "or swap: uncompiled blocks hold more) and the estimate leaves room for the worker's "
                            "pass, not with CUDA graphs nor LoRA dropout; false: step 1 waits for the compile")
    cuda_graphs: bool = Field(False, description="with compile: replay each compiled block as a CUDA graph (less "
                                                 "host time per block), its recompute too where it is compiled "
                                                 "into the block's backward (memory.compiled_recompute: Qwen-Image "
                                                 "1024², rtx4090 profile, 24 GiB cap, one H200: 0.395 s/step "
                                                 "against 0.572, p90/median 1.03 against 1.18; each bucket shape "
                                                 "and text length records its graphs once, 13-17 s); not while "
                                                 "blocks recompute outside their compiled code, nor with "
                                                 "schedule.grad_accum > 1")
    cpp_wrapper: bool | Literal["auto"] = Field(
        False, description="with compile: the compiled blocks launch their kernels from C++ (Inductor's C++ "
                           "wrapper) instead of Python: less host time per step (Qwen-Image 1024², rtx4090 profile, "
                           "24 GiB cap, one H200, recompute not compiled: 0.472 s/step against 0.569, step 1 73 s "
                           "against 29); cuDNN attention then runs as lorakit's own operators, which a recompute "
                           "compiled into the backward can call from C++ (hardware/cudnn_op.py; with it, the same "
                           "machine kind: 0.438 s/step against 0.482, FLUX.1-dev unchanged at 0.364; with another "
                           "attention backend the recompute runs outside the compiled code, said); pays only where "
                           "the host sets the pace (lorakit train, same settings: 0.48 against 0.56-0.57 s/step on "
                           "slower hosts, 0.411 against 0.403 on a faster one), and a machine's first run compiles "
                           "37-65 s longer; needs a C++ compiler (g++, or $CXX); not with CUDA graphs")
    compiled_recompute: bool | Literal["auto"] = Field(
        "auto", description="with compile and gradient checkpointing: each recomputed block's forward and its "
                            "recompute compiled together, the recompute inside the block's backward graph, instead "
                            "of the compiled forward run again in backward (Qwen-Image 1024², rtx4090 profile, 24 "
                            "GiB cap, one H200: 0.46 s/step against 0.57, the same 21.4 GiB peak); auto: wherever "
                            "compiled blocks recompute, not with swapped blocks, FSDP or the background compile "
                            "(true says why where it cannot apply); false: the compiled forward again in backward")
    compute: Literal["bf16", "fp8", "auto"] = Field(
        "bf16", description="matmuls of the frozen base's block Linears: bf16; fp8 (e4m3 inputs and weights "
                            "scaled per token / per row, GPUs of compute capability 8.9+; LoRA stays bf16); auto "
                            "(the 24/32 GB profiles): fp8 over an 8-bit base where this GPU runs the fp8 products, "
                            "else bf16")
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
    prompts: list[Text] = Field(default_factory=list, description="sample prompts (default: the captions of the "
                                                                 "first 4 items); edit families pair prompt k "
                                                                 "with item k's control images (items: the "
                                                                 "held-out validation items if any, else the "
                                                                 "training items); samples are shown beside "
                                                                 "their controls")
    controls: list[Path | list[Path]] = Field(default_factory=list, description="edit families: control images "
                                              "for the prompts, in order (a path, or a list of paths for several "
                                              "controls); prompts without one take item k's")
    steps: int = Field(20, ge=1, description="inference steps per sample")
    first: bool = Field(True, description="render the grid of the untrained LoRA (step 0, right after step 1) to "
                                          "compare the later grids with (taken from lorakit's cache where an earlier "
                                          "run on this machine rendered it from the same model files, prompts, "
                                          "seeds and settings); false skips it (the run says what it costs before "
                                          "it starts)")
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
    name: str = Field("lora", description="file name stem of the LoRA (a name, not a path: it is written inside "
                                          "output.dir)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_last: int = Field(3, ge=1, description="checkpoints kept (a full fine-tune's hold every weight and the "
                                                "optimizer: its run is refused where the disk lacks room for them)")
    checkpoint_format: Literal["sharded", "gathered"] = Field(
        "sharded", description="method=full: sharded = every process writes its own shards in parallel "
                               "(torch.distributed.checkpoint; resumes on any process count; the model is exported "
                               "in diffusers layout at the end, or by `lorakit convert checkpoint`), gathered = rank "
                               "0 writes the whole model in diffusers layout at every checkpoint (LoRA runs: always "
                               "one small file)")
    async_save: bool = Field(True, description="method=full with sharded checkpoints: a step's checkpoint is copied "
                                               "to host memory beside the next step (pinned buffers of this "
                                               "process's share, kept from one save to the next) and written while "
                                               "training goes on (it counts once written)")
    hub_repo: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$",
                                 description="org/name: after a finished LoRA run, `lorakit push` to this Hugging "
                                             "Face repo (the folder is written offline, uploaded online)")
    hub_private: bool = Field(False, description="hub_repo: create it private")
    hub_license: str = Field("other", description="hub_repo: the licence in the model card")


    @field_validator("name")
    @classmethod
    def _a_name(cls, v: str) -> str:
        if not v or len(v) > 200 or v.startswith(".") or any(c in v for c in "/\\\x00"):
            raise ValueError("a file name, not a path: 1-200 characters, no '/' or '\\', not starting with '.' "
                             "(the LoRA is written inside output.dir)")
        return v


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
        facts = family_adapter(self.model.family)
        t = facts.temporal or 1
        if facts.layout == "video" and t > 1:
            bad = [n for n in self.data.frame_counts if (n - 1) % t]
            if bad:
                fix = ", ".join(f"{n} -> {(n - 1) // t * t + 1} or {((n - 1) // t + 1) * t + 1}" for n in bad)
                problems.append(f"data.frames: {info.name} takes {t}k+1 frames (its VAE packs {t} frames into "
                                f"one latent frame after the first); got {bad} ({fix})")
        dirs = self.data.control_dirs
        if facts.max_controls and len(dirs) > facts.max_controls:
            problems.append(f"data.control_dirs: {len(dirs)} folders ({', '.join(dirs)}); {info.name} takes 1 to "
                            f"{facts.max_controls} control images per item")
        if len(set(dirs)) != len(dirs):
            problems.append(f"data.control_dirs: {sorted({d for d in dirs if dirs.count(d) > 1})} listed twice")
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
