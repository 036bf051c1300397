"""The family registry: names people type -> the adapter that knows that model.

Two words, two ideas:
- a **family** is what a user names in a config (`flux`, `flux-kontext`, `qwen-image-edit-plus`, ...): a
  pipeline, its data layout and its conventions;
- an **architecture** (`arch`) is the transformer's weight naming scheme (`flux`, `qwen-image`, `kandinsky5`):
  families that share a transformer class share LoRA key names and conversion rules (FLUX.1-dev and
  FLUX.1 Kontext; Qwen-Image and its edit variants; Kandinsky 5 T2I and T2V).

This module imports nothing heavy, so config validation and `--help` stay fast; the adapter module of a
family (everything the family means: `lorakit.models.<module>`) is imported when first asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import InputError, UnknownNameError


@dataclass(frozen=True)
class FamilyInfo:
    """What lorakit knows about a family name before importing any ML code."""

    name: str
    arch: str  # the transformer's naming scheme (LoRA keys, native names): shared by variants of one model
    module: str  # lorakit.models.<module> holds the adapter, which declares every other fact
    variant: str  # a flag of the adapter (e.g. "edit", "edit-plus"), "" for the base form
    pipeline_class: str  # the stock diffusers pipeline class
    transformer_class: str
    patch: int  # image sides must be multiples of this many pixels (VAE factor x patch size)
    description: str
    # model_index.json entries that tell apart families of one pipeline class: (key, set?) — a component present
    # or a flag true (Wan 2.2 A14B has transformer_2, TI2V-5B expand_timesteps)
    index_marks: tuple[tuple[str, bool], ...] = ()


FAMILIES: dict[str, FamilyInfo] = {
    f.name: f
    for f in [
        FamilyInfo("flux", "flux", "flux", "", "FluxPipeline", "FluxTransformer2DModel", 16,
                   "FLUX.1-dev (guidance-distilled, T5 + CLIP)"),
        FamilyInfo("qwen-image", "qwen-image", "qwen_image", "", "QwenImagePipeline", "QwenImageTransformer2DModel",
                   16, "Qwen-Image (Qwen2.5-VL text encoder)"),
        FamilyInfo("qwen-image-edit", "qwen-image", "qwen_image", "edit", "QwenImageEditPipeline",
                   "QwenImageTransformer2DModel", 16, "Qwen-Image-Edit (one control image)"),
        FamilyInfo("qwen-image-edit-plus", "qwen-image", "qwen_image", "edit-plus", "QwenImageEditPlusPipeline",
                   "QwenImageTransformer2DModel", 16, "Qwen-Image-Edit-Plus 2509/2511 (several control images)"),
        FamilyInfo("qwen-image-edit-2511", "qwen-image", "qwen_image", "edit-plus", "QwenImageEditPlusPipeline",
                   "QwenImageTransformer2DModel", 16,
                   "Qwen-Image-Edit-2511 (several control images, modulated at timestep 0: zero_cond_t)"),
        FamilyInfo("qwen-image-2.1", "qwen-image-2.1", "qwen_image21", "", "QwenImage21Pipeline",
                   "QwenImage21Transformer2DModel", 32, "Qwen-Image-2.1 (Qwen3-VL text encoder, block-causal "
                   "single-stream transformer)"),
        FamilyInfo("kandinsky5-t2i", "kandinsky5", "kandinsky5", "t2i", "Kandinsky5T2IPipeline",
                   "Kandinsky5Transformer3DModel", 16, "Kandinsky 5 text-to-image"),
        FamilyInfo("kandinsky5-t2v", "kandinsky5", "kandinsky5", "t2v", "Kandinsky5T2VPipeline",
                   "Kandinsky5Transformer3DModel", 16, "Kandinsky 5 text-to-video"),
        FamilyInfo("z-image", "z-image", "z_image", "", "ZImagePipeline", "ZImageTransformer2DModel", 16,
                   "Z-Image (Qwen3 text encoder; Turbo is step-distilled: see docs/families.md)"),
        FamilyInfo("flux2-dev", "flux2", "flux2", "dev", "Flux2Pipeline", "Flux2Transformer2DModel", 16,
                   "FLUX.2 [dev] (guidance-distilled, Mistral Small 3.1 text encoder)"),
        FamilyInfo("flux2-klein", "flux2", "flux2", "klein", "Flux2KleinPipeline", "Flux2Transformer2DModel", 16,
                   "FLUX.2 [klein] (Qwen3 text encoder; train klein-base: see docs/families.md)"),
        FamilyInfo("flux2-dev-edit", "flux2", "flux2", "dev-edit", "Flux2Pipeline", "Flux2Transformer2DModel", 16,
                   "FLUX.2 [dev] editing with 1-4 reference images"),
        FamilyInfo("flux2-klein-edit", "flux2", "flux2", "klein-edit", "Flux2KleinPipeline",
                   "Flux2Transformer2DModel", 16, "FLUX.2 [klein] editing with 1-4 reference images"),
        FamilyInfo("flux-kontext", "flux", "flux_kontext", "", "FluxKontextPipeline", "FluxTransformer2DModel", 16,
                   "FLUX.1 Kontext dev (image editing with one control image)"),
        FamilyInfo("wan2.1-t2v", "wan", "wan", "2.1-t2v", "WanPipeline", "WanTransformer3DModel", 16,
                   "Wan 2.1 text-to-video (one transformer: 14B or 1.3B)",
                   (("transformer_2", False), ("expand_timesteps", False))),
        FamilyInfo("wan2.2-t2v", "wan", "wan", "2.2-t2v", "WanPipeline", "WanTransformer3DModel", 16,
                   "Wan 2.2 T2V-A14B (two experts: model.expert high or low)", (("transformer_2", True),)),
        FamilyInfo("wan2.2-i2v", "wan", "wan", "2.2-i2v", "WanImageToVideoPipeline", "WanTransformer3DModel", 16,
                   "Wan 2.2 I2V-A14B (first frame in, two experts: model.expert high or low)",
                   (("transformer_2", True),)),
        FamilyInfo("wan2.2-ti2v-5b", "wan", "wan", "2.2-ti2v", "WanPipeline", "WanTransformer3DModel", 32,
                   "Wan 2.2 TI2V-5B (one transformer, the Wan 2.2 VAE; trained text-to-video)",
                   (("expand_timesteps", True),)),
    ]
}


# how many kinds of repeated block each transformer class declares (diffusers' `_repeated_blocks`: one compiled graph
# each), known without importing diffusers: a first run's compile processes, one per kind, start before it is imported
# (`train.precompile.start_early`); `test_the_block_kind_counts_are_diffusers_own` holds them equal
BLOCK_KINDS = {"FluxTransformer2DModel": 2, "Flux2Transformer2DModel": 2, "Kandinsky5Transformer3DModel": 2,
               "QwenImageTransformer2DModel": 1, "QwenImage21Transformer2DModel": 1, "WanTransformer3DModel": 1,
               "ZImageTransformer2DModel": 1}


def family_names() -> list[str]:
    """All valid family names, in display order."""
    return list(FAMILIES)


def arch_names() -> list[str]:
    """The architectures (weight naming schemes), in display order."""
    return list(dict.fromkeys(f.arch for f in FAMILIES.values()))


def family_info(name: str) -> FamilyInfo:
    """Look a family up by name.

    Raises:
        UnknownNameError: with the closest valid name as a hint.
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownNameError("model family", name, family_names()) from None


def arch_of(name: str) -> str:
    """The architecture of a family or architecture name (`flux-kontext` -> `flux`, `qwen-image` -> itself).

    Raises:
        UnknownNameError: neither a family nor an architecture.
    """
    if name in arch_names():
        return name
    try:
        return FAMILIES[name].arch
    except KeyError:
        raise UnknownNameError("model family or architecture", name,
                               list(dict.fromkeys(family_names() + arch_names()))) from None


def family_of_arch(arch: str) -> str:
    """The first family of an architecture (whose adapter declares the architecture's naming facts)."""
    return next(f.name for f in FAMILIES.values() if f.arch == arch_of(arch))


def family_of_pipeline(pipeline_class: str, index: dict | None = None) -> str | None:
    """The family whose stock pipeline class this is (None if lorakit has none); `index` (model_index.json) tells
    apart the families of one class by their `index_marks`."""
    def is_set(v) -> bool:
        return bool(v[0] is not None) if isinstance(v, list) and v else bool(v)

    for f in FAMILIES.values():
        if f.pipeline_class == pipeline_class and \
                all(is_set((index or {}).get(k)) == want for k, want in f.index_marks):
            return f.name
    return None


def families_help() -> str:
    """One line per family for --help texts (generated, so new families appear by themselves)."""
    return "; ".join(f"{f.name}: {f.description}" for f in FAMILIES.values())


def family_of_folder(model_dir: Path) -> str:
    """The family of a diffusers model folder, from its model_index.json (nothing heavy is read)."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise InputError(f"{model_dir} is a single file, not a diffusers model folder",
                         "a single-file checkpoint goes with the model it was made from: lorakit infer FILE --base "
                         "REPO_OR_FOLDER (model.base in a run config)")
    index_file = model_dir / "model_index.json"
    if not index_file.is_file():
        raise InputError(f"{model_dir} is not a diffusers model folder (no model_index.json)")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        cls_name = index.get("_class_name")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise InputError(f"{index_file}: not a readable model index ({type(e).__name__})") from None
    family = family_of_pipeline(cls_name, index)
    if family is None:
        raise InputError(f"{model_dir} holds a {cls_name}, which is not a lorakit family",
                         "supported pipelines: " + families_help())
    return family
