"""LoRA files in the layouts people use, read into one form and written from it — exactly, nothing dropped.

`read` turns any supported file into a `Lora`: per diffusers module, a patch of its weight (`convert/patches.py`:
LoRA, DoRA, LyCORIS LoKr / LoHa, full differences) and bias differences; every key of the file is used, or
listed in `Lora.unused` with the reason (text-encoder parts, unknown modules, kinds lorakit does not apply).
Layouts read:

- diffusers (`transformer.<module>.lora_A/lora_B.weight`, `lora_magnitude_vector`; alpha from the file's
  `lora_adapter_metadata`, else alpha = rank), ai-toolkit (the same keys), peft folders (`adapter_config.json`),
  DiffSynth-Studio (bare names, `.lora_A.default.weight`), OneTrainer (`lora_transformer_`);
- kohya sd-scripts and musubi-tuner (`lora_unet_<native name with _>.lora_down/lora_up.weight`, `.alpha`),
  ComfyUI (`diffusion_model.<native name>.lora_A/B` or `lora_down/up`, `.alpha`), LyCORIS (`.lokr_*`,
  `.hada_*`, SimpleTuner's `lycoris_` prefix), ComfyUI extracts (`.diff`, `.diff_b`), DoRA's `.dora_scale`.

`write` gives `diffusers` / `peft` (alpha folded into B, so alpha == rank and every consumer — diffusers with
the metadata, ComfyUI and kohya tools without it — applies the same change; DoRA adds `.dora_scale` for
ComfyUI beside peft's magnitudes) and `kohya` / `comfyui` (native names, explicit `.alpha`, LyCORIS and
difference keys kept). Native names and fused weights: `convert/native.py`.
"""

from lorakit.convert.compare import deltas_equal
from lorakit.convert.read import Lora, detect_format, magnitude_to_dora_scale, read
from lorakit.convert.write import FORMATS, to_peft, write

__all__ = ["FORMATS", "Lora", "deltas_equal", "detect_format", "magnitude_to_dora_scale", "read", "to_peft", "write"]
