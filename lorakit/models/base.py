"""The family adapter: the one place that says what a model family is and how to drive it.

A family module (`flux.py`, `qwen_image.py`, `kandinsky5.py`, ...) subclasses `Adapter` and declares every
fact in `Adapter.FACTS` plus the methods below; the cache builder, training loop, sampler, memory estimate,
doctor, bench, infer and convert ask it and never branch on a family name. `missing_facts()` names what a
family forgot (the contract test runs it for every registered family).

Behaviour: an adapter loads only the components it needs (through `lorakit.io`), and computes text
embeddings and latents exactly as the family's stock diffusers pipeline does — by calling that pipeline's
own `encode_prompt` on a pipeline object assembled from the loaded components (no transformer), and by
applying the pipeline's latent normalisation to the VAE's mean. `predict` calls the transformer as the
stock pipeline calls it. `load_adapter(family, None)` gives a conventions-only adapter (no model folder):
facts, `predict`, `example_inputs` and the tiny builder work without one.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import re
from pathlib import Path

from lorakit.errors import ConfigError, InputError
from lorakit.io.modules import load_component
from lorakit.io.stream import stream
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.pixels import to_pixels
from lorakit.models.registry import arch_names, family_info, family_names, family_of_arch


def resolution_mu(image_seq_len: int, scheduler_config: dict) -> float:
    """The flow-matching scheduler's dynamic-shift mu for a number of image tokens (linear in the token count)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


class Adapter(abc.ABC):
    """Base of the family adapters. Class attributes are the family's facts (None = not declared); the
    abstract methods are what every family implements (a family that leaves one out cannot be created, and
    Python's error names the method)."""

    # ---- facts (each family declares all of them; `missing_facts` names any left out) ----
    FACTS = ("layout", "max_controls", "guidance", "guidance_arg", "lora_presets", "published", "attention_cases",
             "full_config", "native_names", "lora_marks", "text_parts", "max_sequence_length", "temporal",
             "comfy_diffusers_prefixes")
    layout: str | None = None  # dataset layout: "flat" (image + caption), "edit" (target + controls), "video"
    max_controls: int | None = None  # control images per item (0 unless layout == "edit")
    guidance: str | None = None  # "embedded" (a guidance input, FLUX) | "cfg" (classifier-free, against empty text)
    guidance_arg: str | None = None  # the stock pipeline's __call__ argument for the guidance scale
    lora_presets: LoraPresets | None = None
    published: Published | None = None
    attention_cases: tuple[AttentionCase, ...] | None = None  # bare SDPA shapes for doctor's self-test
    full_config: dict | None = None  # the published transformer config (bench step, attention model case)
    native_names: tuple[NativeName, ...] | None = None  # original/ComfyUI/kohya module names (LoRA conversion)
    lora_marks: tuple[str, ...] | None = None  # regexes on diffusers module names only this architecture has
    text_parts: tuple[str, ...] | None = None  # pipeline components encode_prompts needs
    max_sequence_length: int | None = None
    temporal: int | None = None  # VAE frames per latent frame (video), 1 for images
    # known failures of SDPA backends inside this architecture: (backend, cuDNN version prefix, capability, why)
    known_bad_attention: tuple[tuple[str, str, str, str], ...] = ()
    # prefixes under which ComfyUI's LoRA loader (comfy/lora.py, model_lora_keys_unet) takes this architecture's
    # diffusers module names ("" = the bare name, DiffSynth); native names it always takes under "diffusion_model."
    # and, with "_" for ".", under "lora_unet_"
    comfy_diffusers_prefixes: tuple[str, ...] | None = None
    # regexes of the diffusers module names ComfyUI's key map takes under those prefixes (None: every name of the
    # native table); the others load in ComfyUI under their native names only (`convert --to comfyui`)
    comfy_diffusers_names: tuple[str, ...] | None = None
    # native name suffix -> output rows per input column of that fused weight: tells apart architectures that share
    # their original names (FLUX.1's single-block linear1 holds 7 widths, FLUX.2's 9)
    native_fused_ratios: dict = {}
    # whether the readers of ComfyUI-layout files ("diffusion_model.<native>") take `.alpha` keys; where one does not
    # (diffusers' FLUX.2 reader of ai-toolkit files refuses them), `--to comfyui` folds alpha into the up matrices
    native_alpha_keys = True
    vae_part = "vae"
    lora_file_layout = "diffusers"  # the layout a run writes its LoRA in (Wan: "comfyui", the layout both read)
    first_frame = False  # image-to-video: generation starts from an image (infer's --image; training: the clip's own)
    experts: tuple[str, ...] = ()  # the experts of a mixture-of-experts pipeline (Wan 2.2 A14B: high, low)
    vae_factor = 8  # pixels per latent row/column (an 8x VAE; FLUX.2 folds 2x2 patches in: 16)
    latent_channels = 16  # channels of the cached latents (FLUX.2: 128)
    meta_forward = True  # the transformer runs on the meta device (shapes alone: bench's FLOP count); Qwen-Image-2.1's
    # reads its token layout from the slot mask's values, so it counts its FLOPs itself (`forward_flops`)
    token_pixels: int | None = None  # pixels per transformer token side (None: the pixel multiple, `info.patch`;
    # Qwen-Image-2.1: 16, one token per latent, though sides are multiples of 32)

    def __init__(self, family: str, model_dir, device: str = "cpu", dtype=None, backend: str = "auto"):
        self.info = family_info(family)
        self.family = family
        self.device = device
        self._dtype = dtype
        self.backend = backend
        self.parts: dict = {}
        self.streamed: dict = {}  # component -> None (to stream when loaded) or what `io.stream.stream` did
        self._pipe = None
        if model_dir is None:  # conventions only: facts, predict, example inputs, tiny builder
            self.model_dir, self.index = None, {}
            return
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model_index.json"
        if not index.is_file():
            raise InputError(f"{self.model_dir} is not a diffusers pipeline folder (no model_index.json)",
                             "point model.path at the folder downloaded from the hub")
        try:
            self.index = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InputError(f"{index}: not readable JSON ({type(e).__name__})",
                             "re-download the model folder") from None
        if not isinstance(self.index, dict) or self.index.get("_class_name") != self.info.pipeline_class:
            got = self.index.get("_class_name") if isinstance(self.index, dict) else None
            raise InputError(f"{self.model_dir} holds a {got}, not the {self.info.pipeline_class} that family "
                             f"{family} needs", "check model.family and model.path")

    @property
    def dtype(self):
        import torch

        return self._dtype or torch.float32

    @property
    def arch(self) -> str:
        return self.info.arch

    # ------------------------------------------------------------------ facts

    @classmethod
    def missing_facts(cls) -> list[str]:
        """The facts and methods this family has not declared (empty when complete)."""
        missing = [f for f in cls.FACTS if getattr(cls, f, None) is None]
        for m in ("encode_prompts", "encode_images", "decode_latents", "predict", "example_inputs", "build_tiny",
                  "transformer_size"):
            if getattr(cls, m) is getattr(Adapter, m):
                missing.append(m)
        return missing

    def latent_hw(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of an image's latent at this pixel size."""
        return height // self.vae_factor, width // self.vae_factor

    def image_seq_len(self, latent_shape) -> int:
        """Transformer tokens of one latent frame of this shape (the flow-matching scheduler's resolution shift
        counts them): (rows / p) x (columns / p) for the transformer's patch of p latents a side."""
        p = self.token_side // self.vae_factor
        return (latent_shape[-2] // p) * (latent_shape[-1] // p)

    @property
    def token_side(self) -> int:
        """Pixels per transformer token side."""
        return self.token_pixels or self.info.patch

    @abc.abstractmethod
    def transformer_size(self, config: dict) -> tuple[int, int]:
        """(width of the repeated blocks, number of repeated blocks) of a transformer config (config.json's keys,
        as the family's transformer class names them): the memory estimate's facts."""

    def shift_mu(self, image_seq_len: int, scheduler_config: dict, steps: int | None = None) -> float | None:
        """The dynamic shift (mu) the stock pipeline samples `steps` steps with at this token count (None: the
        scheduler shifts by its fixed `shift`). Default: the scheduler's linear rule; training draws its sigmas
        with the same mu (`steps` None)."""
        return resolution_mu(image_seq_len, scheduler_config) if scheduler_config.get("use_dynamic_shifting") else None

    def preset_modules(self, preset: str) -> tuple[str, ...]:
        """Module-name suffixes of a `lora.targets` preset (attention | attention_mlp)."""
        p = self.lora_presets
        return p.attention + (p.mlp if preset == "attention_mlp" else ())

    def image_tokens(self, resolution: int, frames: int = 1, controls: int | None = None,
                     control_resolution: int | None = None) -> int:
        """Transformer tokens of one item at a square resolution: its latents (frames counted) and its control
        images (default: the family's maximum) at the size the family encodes them (`control_size`)."""
        per_image = (resolution // self.token_side) ** 2
        latent_frames = (frames - 1) // self.temporal + 1 if self.layout == "video" else 1
        n = self.max_controls if controls is None else controls
        per_control = 0
        if n:
            w, h = self.control_size(resolution, resolution, control_resolution)
            per_control = (w // self.token_side) * (h // self.token_side)
        return per_image * latent_frames + n * per_control

    def control_size(self, width: int, height: int, resolution: int | None = None) -> tuple[int, int]:
        """(width, height) at which the stock pipeline VAE-encodes a control image of this size (edit families;
        `resolution`: about resolution² pixels at the image's aspect ratio instead, `data.control_resolution`)."""
        raise InputError(f"family {self.family} takes no control images")

    def prompt_controls(self, images: list) -> list | None:
        """The control images as the stock pipeline hands them to its text encoder (None: the prompt does not see
        them), from the images as given."""
        return None

    def encode_controls(self, images: list, resolution: int | None = None) -> list:
        """Control images as given (PIL) -> one latent (C, h, w) each, resized by `control_size` as the stock
        pipeline resizes them (Lanczos, no crop) and encoded one at a time."""
        from PIL import Image

        out = []
        for im in images:
            size = self.control_size(*im.size, resolution)
            out.append(self.encode_images(to_pixels([im.resize(size, Image.LANCZOS)]))[0])
        return out

    def native_table(self, n_blocks: int) -> dict[str, NativeName]:
        """native name -> its record, with `{i}` expanded for blocks 0 .. n_blocks-1."""
        out = {}
        for n in self.native_names:
            if "{i}" in n.native:
                for i in range(n_blocks):
                    out[n.native.format(i=i)] = NativeName(n.native.format(i=i),
                                                           tuple(t.format(i=i) for t in n.targets),
                                                           n.split, n.swap_halves, n.param)
            else:
                out[n.native] = n
        return out

    @property
    def native_is_diffusers(self) -> bool:
        """The original checkpoints use the diffusers module names (Qwen-Image, Kandinsky 5)."""
        return all(n.targets == (n.native,) and not n.swap_halves and n.param == "weight" for n in self.native_names)

    @classmethod
    def recognises(cls, modules) -> bool:
        """Do these diffusers module names belong to this architecture only?"""
        return any(re.search(p, m) for p in cls.lora_marks for m in modules)

    def call_kwargs(self, width: int, height: int, frames: int = 1) -> dict:
        """Size arguments for the stock pipeline's __call__ (families that accept only some sizes override)."""
        return {"width": width, "height": height}

    def forward_flops(self, config: dict, batch) -> float | None:
        """FLOPs of one forward (matmuls and attention, as torch's FlopCounterMode counts them) for a family whose
        transformer cannot run on the meta device (`meta_forward` False); None: count them there."""
        return None

    def file_layout(self, modules) -> str:
        """The layout a run writes a LoRA on these modules (diffusers names) in: `lora_file_layout`, unless the
        family chooses per file (Qwen-Image-2.1)."""
        return self.lora_file_layout

    def before_compile(self, transformer) -> None:
        """Changes that let the compiler generate each repeated block whole, same numbers (default: none).
        Called on the training transformer just before its blocks are compiled."""
        return None  # the stock blocks of most families compile whole as they are

    def trained_part(self, expert: str | None = None) -> str:
        """The pipeline component a run trains (`model.expert` picks one of several experts)."""
        self.expert(expert)
        return "transformer"

    def expert(self, expert: str | None) -> str | None:
        """The expert a run trains (None: the family has one transformer).

        Raises:
            ConfigError: an expert named for a family without experts.
        """
        if expert is not None:
            raise ConfigError([f"model.expert: {expert} — {self.family} has one transformer, no experts"],
                              hint="leave model.expert out")
        return None

    def sigma_range(self, expert: str | None = None) -> tuple[float, float]:
        """The sigmas the trained transformer denoises at sampling time (an expert: its part of the trajectory);
        training draws its sigmas in this range only."""
        return (0.0, 1.0)

    def encode_clip_condition(self, frames):
        """What a clip (B, 3, T, H, W) conditions its own generation with (image-to-video: its first frame), cached
        as the item's control latents; None where the family has no such condition."""
        return None

    @abc.abstractmethod
    def attention_model_config(self) -> dict:
        """The full-width transformer config with one block of each kind (doctor's in-model attention case)."""

    # ------------------------------------------------------------------ loading

    def load(self, names) -> None:
        """Load components (weights through lorakit.io; tokenizers/processors by their own class)."""
        for name in names:
            if name in self.parts:
                continue
            entry = self.index.get(name)
            if not component_entry(entry) or entry[0] is None:  # absent, or a setting (boundary_ratio, ...)
                self.parts[name] = None
                continue
            folder = self.model_dir / name
            if name in self.streamed and str(self.device).startswith("cuda"):  # larger than the GPU: its blocks
                self.parts[name] = load_component(folder, "cpu", self.dtype, self.backend)  # visit one at a time
                self.streamed[name] = stream(self.parts[name], self.device)
            elif (folder / "config.json").is_file() and any(folder.glob("*.safetensors*")):
                self.parts[name] = load_component(folder, self.device, self.dtype, self.backend)
            else:
                import importlib

                cls = getattr(importlib.import_module(entry[0]), entry[1])
                self.parts[name] = cls.from_pretrained(folder)
        self._pipe = None

    def unload(self, names) -> None:
        """Free components (e.g. the text encoders once everything is cached)."""
        for n in names:
            self.parts.pop(n, None)
        self._pipe = None
        if any(self.streamed.get(n) for n in names):  # a streamed encoder's host copies (its blocks' visit hooks
            import gc  # hold them) go now, not whenever the collector next runs: tens of GiB, often pinned

            import torch

            gc.collect()
            if torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()  # torch keeps freed page-locked memory for reuse: back to the host
            self.streamed.update({n: None for n in names if n in self.streamed})  # streamed again if reloaded

    def pipeline(self):
        """The stock pipeline object over the loaded components (those not loaded are None)."""
        if self._pipe is None:
            import inspect

            cls = self.pipeline_class()
            wanted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
            # the pipeline's own settings from model_index.json (Wan: boundary_ratio, expand_timesteps), components
            # as loaded (those not loaded are None)
            settings = {k: v for k, v in self.index.items() if k in wanted and not component_entry(v)}
            self._pipe = cls(**{k: settings[k] if k in settings else self.parts.get(k) for k in wanted})
        return self._pipe

    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.info.pipeline_class)

    def identity(self, names=None) -> str:
        """A fingerprint of the components that produce cached values: their configs, file sizes and the
        first and last MiB of every weight file. Changing the model changes it; re-running does not."""
        h = hashlib.sha256(self.family.encode())
        for name in sorted(names or (*self.text_parts, self.vae_part)):
            folder = self.model_dir / name
            if not folder.is_dir():
                continue
            for p in sorted(folder.iterdir()):
                if not p.is_file():
                    continue
                h.update(p.name.encode())
                size = p.stat().st_size
                h.update(str(size).encode())
                with open(p, "rb") as f:
                    h.update(f.read(2**20))
                    if size > 2**20:
                        f.seek(max(size - 2**20, 2**20))
                        h.update(f.read())
        return h.hexdigest()[:24]

    # ------------------------------------------------------------------ what families provide

    @abc.abstractmethod
    def encode_prompts(self, texts: list[str], controls=None) -> list[dict]:
        """Per text: name -> tensor (no batch dimension; padding removed)."""

    @abc.abstractmethod
    def encode_images(self, pixels):
        """pixels (B, 3, H, W) in [-1, 1] -> normalised latents as the family's transformer sees them."""

    @abc.abstractmethod
    def decode_latents(self, latents):
        """Normalised latents -> pixels (B, 3, H, W) in [-1, 1] (training-time samples)."""

    def encode_video(self, frames):
        """frames (B, 3, T, H, W) in [-1, 1] -> normalised latents (video families)."""
        raise InputError(f"family {self.family} does not take video")

    @abc.abstractmethod
    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The transformer's velocity for noisy latents x_t at per-item sigmas, called as the stock pipeline
        calls it (the training loss, the sampler, bench and the oracle tests all use this one call)."""

    @abc.abstractmethod
    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        """A synthetic batch (CPU tensors, `train.data.Batch`) shaped as the cache gives it for a transformer
        of this config: latents, text embeddings (+ mask / pooled), control latents for edit families."""

    @abc.abstractmethod
    def build_tiny(self, seed: int):
        """The tiny random pipeline object of this family (`lorakit.models.tiny` saves and caches it)."""


def component_entry(value) -> bool:
    """Is this model_index.json value a component (["library", "Class"], [null, null] when absent) rather than a
    setting of the pipeline (a number, a flag, a list of numbers such as Qwen-Image-2.1's sample_sigmas)?"""
    return isinstance(value, list) and len(value) == 2 and all(v is None or isinstance(v, str) for v in value)


def load_adapter(family: str, model_dir, device: str = "cpu", dtype=None, backend: str = "auto") -> Adapter:
    """The adapter of a family, by name (model_dir None: conventions only)."""
    import importlib

    mod = importlib.import_module(f"lorakit.models.{family_info(family).module}")
    return mod.ADAPTER(family, model_dir, device=device, dtype=dtype, backend=backend)


@functools.cache
def family_adapter(family: str) -> Adapter:
    """The conventions-only adapter of a family (facts and pure functions; shared, cached)."""
    return load_adapter(family, None)


def trained_dir(cfg) -> Path | None:
    """The folder of the transformer a run trains (`<model>/transformer`; an expert's, `model.expert`; with both,
    the first one trained: the experts share an architecture), None without a model folder."""
    if not cfg.model.path:
        return None
    expert = "high" if cfg.model.expert == "both" else cfg.model.expert
    return Path(cfg.model.path) / family_adapter(cfg.model.family).trained_part(expert)


def arch_adapter(arch: str) -> Adapter:
    """The adapter that declares an architecture's naming facts (its first family)."""
    return family_adapter(family_of_arch(arch))


def vae_factor(family: str | None, channels: int | None = None) -> int:
    """Pixels per latent side of a family's VAE; with no family named, the factor every family whose latents have
    `channels` channels (any, when None) shares.

    Raises:
        InputError: no family named and those families' VAEs differ.
    """
    if family is not None:
        return family_adapter(family).vae_factor
    adapters = [family_adapter(f) for f in family_names()]
    factors = {a.vae_factor for a in adapters if channels is None or a.latent_channels == channels}
    if len(factors) != 1:
        raise InputError("the families' VAEs scale images differently"
                         + (f" (latents of {channels} channels)" if channels is not None else ""),
                         "name the family (--family)")
    return factors.pop()


def guess_arch(modules) -> str | None:
    """The architecture whose marks these diffusers module names carry most (None when they say nothing or two
    say as much, e.g. an attention-only LoRA, whose names FLUX and Qwen-Image share)."""
    modules = list(modules)
    counts = {a: sum(1 for m in modules if any(re.search(p, m) for p in arch_adapter(a).lora_marks))
              for a in arch_names()}
    best = max(counts.values(), default=0)
    found = [a for a, n in counts.items() if n == best and n]
    return found[0] if len(found) == 1 else None  # the architecture most of the names mark (FLUX.2 kept x_embedder)
