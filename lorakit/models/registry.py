"""The family registry: names people type -> the adapter that knows that architecture.

This module imports nothing heavy, so config validation and `--help` stay fast; adapters are
imported when first asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.errors import UnknownNameError


@dataclass(frozen=True)
class FamilyInfo:
    """What lorakit knows about a family name before importing any ML code."""

    name: str
    module: str  # lorakit.models.<module> holds the adapter
    variant: str  # a flag of the adapter (e.g. "edit", "edit-plus"), "" for the base form
    pipeline_class: str  # the stock diffusers pipeline class
    transformer_class: str
    patch: int  # image sides must be multiples of this many pixels (VAE factor x patch size)
    description: str


FAMILIES: dict[str, FamilyInfo] = {
    f.name: f
    for f in [
        FamilyInfo("flux", "flux", "", "FluxPipeline", "FluxTransformer2DModel", 16,
                   "FLUX.1-dev (guidance-distilled, T5 + CLIP)"),
        FamilyInfo("qwen-image", "qwen_image", "", "QwenImagePipeline", "QwenImageTransformer2DModel", 16,
                   "Qwen-Image (Qwen2.5-VL text encoder)"),
        FamilyInfo("qwen-image-edit", "qwen_image", "edit", "QwenImageEditPipeline",
                   "QwenImageTransformer2DModel", 16, "Qwen-Image-Edit (one control image)"),
        FamilyInfo("qwen-image-edit-plus", "qwen_image", "edit-plus", "QwenImageEditPlusPipeline",
                   "QwenImageTransformer2DModel", 16, "Qwen-Image-Edit-Plus 2509/2511 (several control images)"),
        FamilyInfo("kandinsky5-t2i", "kandinsky5", "t2i", "Kandinsky5T2IPipeline",
                   "Kandinsky5Transformer3DModel", 16, "Kandinsky 5 text-to-image"),
        FamilyInfo("kandinsky5-t2v", "kandinsky5", "t2v", "Kandinsky5T2VPipeline",
                   "Kandinsky5Transformer3DModel", 16, "Kandinsky 5 text-to-video"),
    ]
}


def family_names() -> list[str]:
    """All valid family names, in display order."""
    return list(FAMILIES)


def family_info(name: str) -> FamilyInfo:
    """Look a family up by name.

    Raises:
        UnknownNameError: with the closest valid name as a hint.
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownNameError("model family", name, family_names()) from None

