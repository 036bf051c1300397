"""The family adapter: what the cache builder (and later the training loop) asks of a model family.

An adapter loads only the components it needs (through `lorakit.io`), and computes text embeddings and
latents exactly as the family's stock diffusers pipeline does — by calling that pipeline's own
`encode_prompt` on a pipeline object assembled from the loaded components (no transformer), and by
applying the pipeline's latent normalisation to the VAE's mean. Family modules only say what differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lorakit.errors import InputError
from lorakit.models.registry import family_info


class Adapter:
    """Base of the family adapters (flux.py, qwen_image.py, kandinsky5.py)."""

    text_parts: tuple[str, ...] = ()  # pipeline component names needed for encode_prompts
    vae_part = "vae"

    def __init__(self, family: str, model_dir, device: str = "cpu", dtype=None, backend: str = "auto"):
        import torch

        self.info = family_info(family)
        self.family = family
        self.device = device
        self.dtype = dtype or torch.float32
        self.backend = backend
        self.parts: dict = {}
        self._pipe = None
        if model_dir is None:  # conventions only (predict): bench step's random-weight transformers
            self.model_dir, self.index = None, {}
            return
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "model_index.json").is_file():
            raise InputError(f"{self.model_dir} is not a diffusers pipeline folder (no model_index.json)",
                             "point model.path at the folder downloaded from the hub")
        self.index = json.loads((self.model_dir / "model_index.json").read_text())
        if self.index.get("_class_name") != self.info.pipeline_class:
            raise InputError(f"{self.model_dir} holds a {self.index.get('_class_name')}, not the "
                             f"{self.info.pipeline_class} that family {family} needs",
                             "check model.family and model.path")

    # ------------------------------------------------------------------ loading

    def load(self, names) -> None:
        """Load components (weights through lorakit.io; tokenizers/processors by their own class)."""
        from lorakit.io.modules import load_component

        for name in names:
            if name in self.parts:
                continue
            entry = self.index.get(name)
            if not isinstance(entry, list) or entry[0] is None:
                self.parts[name] = None
                continue
            folder = self.model_dir / name
            if (folder / "config.json").is_file() and any(folder.glob("*.safetensors*")):
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

    def pipeline(self):
        """The stock pipeline object over the loaded components (those not loaded are None)."""
        if self._pipe is None:
            import importlib
            import inspect

            cls = getattr(importlib.import_module("diffusers"), self.info.pipeline_class)
            wanted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
            self._pipe = cls(**{k: self.parts.get(k) for k in wanted})
        return self._pipe

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

    def encode_prompts(self, texts: list[str], controls=None) -> list[dict]:
        """Per text: name -> tensor (no batch dimension; padding removed)."""
        raise NotImplementedError  # Protocol: each family module implements it

    def encode_images(self, pixels):
        """pixels (B, 3, H, W) in [-1, 1] -> normalised latents as the family's transformer sees them."""
        raise NotImplementedError  # Protocol: each family module implements it

    def decode_latents(self, latents):
        """Normalised latents -> pixels (B, 3, H, W) in [-1, 1] (training-time samples)."""
        raise NotImplementedError  # Protocol: each family module implements it

    def encode_video(self, frames):
        """frames (B, 3, T, H, W) in [-1, 1] -> normalised latents (video families)."""
        raise InputError(f"family {self.family} does not take video")


def load_adapter(family: str, model_dir, device: str = "cpu", dtype=None, backend: str = "auto") -> Adapter:
    """The adapter of a family, by name."""
    import importlib

    mod = importlib.import_module(f"lorakit.models.{family_info(family).module}")
    return mod.ADAPTER(family, model_dir, device=device, dtype=dtype, backend=backend)
