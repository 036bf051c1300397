"""Reading LoRA files in the layouts people use into one form (`Lora`): per diffusers module, a patch of its weight
and bias differences; every key of the file is used, or listed in `Lora.unused` with the reason. The layouts read
are listed in `convert/lora.py`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.convert.native import (
    diffusers_table,
    dora_scale_order,
    guess_native_arch,
    split_bias,
    split_patch,
    swapped_modules,
)
from lorakit.convert.patches import Full, LoHa, LoKr, LowRank, Rows, kind_name
from lorakit.errors import FileFormatError, InputError
from lorakit.io import load, read_header
from lorakit.models.base import guess_arch
from lorakit.models.native import identity_arch, n_blocks, native_table
from lorakit.models.registry import arch_names

# key suffix -> role, longest first when matching
_ROLES = {
    ".lora_A.default.weight": "A", ".lora_B.default.weight": "B", ".lora_A.weight": "A", ".lora_B.weight": "B",
    ".lora_down.weight": "A", ".lora_up.weight": "B", ".lora.down.weight": "A", ".lora.up.weight": "B",
    "_lora.down.weight": "A", "_lora.up.weight": "B", ".lora_linear_layer.down.weight": "A",
    ".lora_linear_layer.up.weight": "B", ".lora_A": "A", ".lora_B": "B",
    ".lora_magnitude_vector": "magnitude", ".lora_magnitude_vector.weight": "magnitude", ".alpha": "alpha",
    ".dora_scale": "dora_scale", ".diff": "diff", ".diff_b": "diff_b",
    **{f".{n}": n for n in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
                            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")},
    ".lora_mid.weight": "unsupported", ".set_weight": "unsupported", ".w_norm": "unsupported",
    ".b_norm": "unsupported", ".reshape_weight": "unsupported", ".lora_B.bias": "unsupported",
}
_SUFFIXES = sorted(_ROLES, key=len, reverse=True)
# prefix -> (namespace, names use "_" for ".")
_NAMESPACES = (("transformer.", "diffusers", False), ("base_model.model.", "diffusers", False),
               ("diffusion_model.", "native", False), ("lora_unet_", "native", True),
               ("lycoris_", "diffusers", True), ("lora_transformer_", "diffusers", True))
_TEXT_ENCODER = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_prior_te_", "text_encoder.",
                 "text_encoder_2.", "text_encoders.", "te1.", "te2.")


@dataclass
class Lora:
    """A LoRA file, read: patches of weights and bias differences by diffusers module name."""

    weights: dict = field(default_factory=dict)  # module -> LowRank | LoKr | LoHa | Full | Rows
    biases: dict = field(default_factory=dict)  # module -> bias difference (tensor)
    facts: dict = field(default_factory=dict)
    unused: list = field(default_factory=list)  # (file key, why): reported, not applied

    def __iter__(self):  # `for module in lora`, `module in lora`: its weight patches
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)

    def __getitem__(self, m):
        return self.weights[m]

    def items(self):
        return self.weights.items()


# --------------------------------------------------------------------------- reading


def read(path, arch: str | None = None, strict: bool = False, base: dict | None = None) -> Lora:
    """Read a LoRA in any supported layout.

    Args:
        arch: the architecture (registry `arch`) when known; else it is told from the keys where they say it.
        strict: fail when any key of the file cannot be applied (instead of listing it in `unused`).
        base: diffusers module -> base weight, to turn a ComfyUI `dora_scale` into peft's magnitude.

    Raises:
        InputError / FileFormatError: naming the file, for anything that is not a LoRA lorakit can read.
    """
    try:
        lora = _read(path, arch, base)
    except (FileFormatError, InputError) as e:
        if str(path) in e.message or type(e) not in (FileFormatError, InputError):
            raise
        raise type(e)(f"{path}: {e.message}", e.hint) from None
    if strict and lora.unused:
        k, why = lora.unused[0]
        raise InputError(f"{path}: {len(lora.unused)} key(s) cannot be applied, e.g. {k} ({why})",
                         "drop --strict to apply the rest and list these")
    return lora


def _load(path: Path):
    config = None
    if path.is_dir():
        cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not weights.is_file():
            raise InputError(f"{path}: no adapter_model.safetensors (a peft adapter folder has one)")
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise FileFormatError(f"{cfg_file}: not JSON") from None
        path = weights
    elif path.suffix.lower() in (".pt", ".pth", ".bin", ".ckpt"):
        raise InputError(f"{path}: pickled files are not read (loading them can run code)",
                         "convert it to .safetensors with the tool that wrote it")
    header = read_header(path)
    tensors = load(path, copy=True)
    if not tensors:
        raise InputError(f"{path}: the file holds no tensors")
    meta = header.metadata or {}
    if config is None and meta.get("lora_adapter_metadata"):
        try:
            config = {k.removeprefix("transformer."): v for k, v in json.loads(meta["lora_adapter_metadata"]).items()}
        except (ValueError, AttributeError):
            raise FileFormatError("lora_adapter_metadata is not a JSON object") from None
    return tensors, config, meta


def _split_key(k: str):
    """(namespace, uses '_', module, role) of a key; namespace None for keys lorakit does not read."""
    if k.startswith(_TEXT_ENCODER):
        return "text-encoder", False, k, None
    suffix = next((s for s in _SUFFIXES if k.endswith(s)), None)
    if suffix is None:
        return None, False, k, None
    stem = k[: -len(suffix)]
    for prefix, ns, flat_names in _NAMESPACES:
        if stem.startswith(prefix):
            return ns, flat_names, stem[len(prefix):], _ROLES[suffix]
    return "diffusers", False, stem, _ROLES[suffix]  # bare names: DiffSynth-Studio, plain peft


def detect_format(keys) -> str:
    keys = list(keys)
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya"
    if any(k.startswith("diffusion_model.") for k in keys):
        return "comfyui"
    if any(k.startswith("lycoris_") for k in keys):
        return "lycoris"
    if any(k.startswith("base_model.model.") for k in keys):
        return "peft"
    if any(k.startswith("transformer.") for k in keys):
        return "diffusers"
    if any(".default.weight" in k for k in keys):
        return "diffsynth"
    if any(k.startswith("lora_transformer_") for k in keys):
        return "onetrainer"
    return "peft"


def _read(path, arch: str | None, base: dict | None) -> Lora:
    path = Path(path)
    tensors, config, meta = _load(path)
    lora = Lora()
    groups: dict = {}
    for k, t in tensors.items():
        ns, flat_names, module, role = _split_key(k)
        if ns is None:
            lora.unused.append((k, "not a LoRA key"))
        elif ns == "text-encoder":
            lora.unused.append((k, "a text-encoder part (lorakit applies the transformer part)"))
        elif role == "unsupported":
            lora.unused.append((k, "a patch kind lorakit does not apply (conv LoRA, norm or reshape patch)"))
        else:
            groups.setdefault((ns, flat_names, module), {})[role] = (k, t)
    if not groups:
        raise InputError("no LoRA weights in this file (no lora_A/lora_B, lora_down/lora_up, LyCORIS or diff keys)",
                         "is it a model checkpoint rather than a LoRA?")
    native = {g: v for g, v in groups.items() if g[0] == "native"}
    asked = arch
    alpha_of = _config_alpha(config)
    written = meta.get("lorakit_arch")  # lorakit names the architecture in every file it writes
    arch = arch or (written if written in arch_names() else None) or _guess_arch(groups, alpha_of)
    blocks = n_blocks(m for _, _, m in groups)
    for (ns, flat_names, module), roles in groups.items():
        keys = [k for k, _ in roles.values()]
        try:
            patch, bias = _patch(module, roles, alpha_of)
        except FileFormatError as e:
            raise FileFormatError(f"{keys[0]}: {e.message}", e.hint) from None
        name = module
        if ns == "native" or flat_names:
            table = (native_table(arch, blocks, flat_names) if ns == "native" else
                     diffusers_table(arch, blocks, True)) if arch else {}
            if not arch and ns != "native":  # shared names: every architecture that knows one reads it alike

                readings = {diffusers_table(a, blocks, True).get(module) for a in arch_names()} - {None}
                table = {module: readings.pop()} if len(readings) == 1 else {}
            rec = table.get(module)
            if rec is None and not (ns == "native" and not flat_names and arch and identity_arch(arch)):
                lora.unused += [(k, f"no {arch or 'known'} module named {module}") for k in keys]
                continue
            if ns == "native" and rec is not None:  # original names: fused and swapped rows become diffusers'
                if patch is not None:
                    lora.weights.update(split_patch(patch, rec))
                if bias is not None:
                    lora.biases.update(split_bias(bias, rec, patch.shape[1] if patch is not None else None))
                continue
            if ns != "native":
                name = rec  # the diffusers name behind a lycoris_ / lora_transformer_ key
        if patch is not None:
            lora.weights[name] = patch
        if bias is not None:
            lora.biases[name] = bias
    # a dora_scale under a diffusers name is in the original weight's row order (ComfyUI's reading): to diffusers'
    swapped = swapped_modules(arch, blocks)
    for ns, flat_names, module in groups:
        name = module if not flat_names else diffusers_table(arch, blocks, True).get(module) if arch else None
        if ns != "native" and name in lora.weights and isinstance(lora.weights[name], LowRank):
            lora.weights[name] = dora_scale_order(lora.weights[name], name, swapped)
    _dora_to_magnitude(lora, base)
    _check_finite(lora)

    guessed = guess_arch(lora.weights) if lora.weights else None
    if asked and guessed not in (None, asked) and not native:
        raise InputError(f"{path} is a {guessed} LoRA (its module names say so), not a {asked} one",
                         "use a LoRA trained for this model (or the right --family)")
    if native and asked and not lora.weights and not lora.biases:
        raise InputError(f"none of its module names is a {asked} module", "is it for another model?")
    fmt = detect_format(tensors)
    kinds = sorted({kind_name(p) for p in lora.weights.values()} | ({"diff_b"} if lora.biases else set()))
    first = next(iter(lora.weights.values()), None)
    lora.facts = {"format": fmt, "arch": arch or guessed, "modules": len(lora.weights),
                  "ranks": sorted({p.rank for p in lora.weights.values() if isinstance(p, LowRank)}),
                  "kinds": kinds, "biases": len(lora.biases), "keys": len(tensors), "unused": len(lora.unused),
                  "dtype": str(_first_tensor(first).dtype).removeprefix("torch.") if first is not None else None}
    if meta.get("lorakit_expert"):  # the expert of a two-expert model it was trained for (Wan 2.2 A14B)
        lora.facts["expert"] = meta["lorakit_expert"]
    return lora


def _first_tensor(p):
    p = p.parent if isinstance(p, Rows) else p
    for a in ("A", "w1", "w1_a", "w1a", "diff"):
        if getattr(p, a, None) is not None:
            return getattr(p, a)
    raise FileFormatError("empty patch")


def _guess_arch(groups: dict, alpha_of=None) -> str | None:
    native = [m for (ns, _, m) in groups if ns == "native"]
    flats = {fl for (ns, fl, _) in groups if ns == "native"}
    if native:
        shapes = {}
        for (ns, _, m), roles in groups.items():
            try:
                p = _patch(m, roles, alpha_of)[0] if ns == "native" else None
                if p is not None:
                    shapes[m] = tuple(p.shape[:2])
            except (FileFormatError, AttributeError, IndexError):
                continue  # reported where the patch is read
        return guess_native_arch(native, flat_names=True in flats, shapes=shapes)
    dotted = [m for (ns, fl, m) in groups if ns == "diffusers" and not fl]
    if dotted:
        return guess_arch(dotted)
    flat_mods = [m for (ns, fl, m) in groups if ns == "diffusers" and fl]  # lycoris_, lora_transformer_
    n = n_blocks(flat_mods)
    tables = {a: diffusers_table(a, n, True) for a in arch_names()}
    dotted = [next(t[m] for t in tables.values() if m in t) for m in flat_mods if any(m in t for t in tables.values())]
    return guess_arch(dotted) if dotted else None  # None when the names are shared (attention-only)


def _patch(module: str, roles: dict, alpha_of):
    """(weight patch or None, bias difference or None) of one module's keys."""
    t = {r: v for r, (_, v) in roles.items()}
    alpha = float(t["alpha"]) if "alpha" in t else None
    patch = None
    if "A" in t or "B" in t:
        if "A" not in t or "B" not in t:
            raise FileFormatError(f"lora_{'B' if 'A' in t else 'A'} is missing (an up/down pair is incomplete)")
        a, b = t["A"], t["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise FileFormatError(f"LoRA shapes do not fit (A {tuple(a.shape)}, B {tuple(b.shape)})",
                                  "only Linear-layer LoRAs are applied")
        if alpha is None:
            alpha = alpha_of(module, int(a.shape[0]))
        mag = t.get("magnitude")
        ds = t.get("dora_scale")
        if ds is not None and ds.dim() == 1:
            ds = ds.reshape(-1, 1)
        patch = LowRank(a, b, alpha, None if mag is None else mag.reshape(-1), ds)
    elif any(r.startswith("lokr_") for r in t):
        if "lokr_t2" in t:
            raise FileFormatError("LoKr with a Tucker core (conv layers) is not applied")
        patch = LoKr(t.get("lokr_w1"), t.get("lokr_w2"), alpha, t.get("lokr_w1_a"), t.get("lokr_w1_b"),
                     t.get("lokr_w2_a"), t.get("lokr_w2_b"))
    elif any(r.startswith("hada_") for r in t):
        if "hada_t1" in t or "hada_t2" in t:
            raise FileFormatError("LoHa with Tucker cores (conv layers) is not applied")
        missing = [n for n in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") if n not in t]
        if missing:
            raise FileFormatError(f"LoHa factors missing: {', '.join(missing)}")
        patch = LoHa(t["hada_w1_a"], t["hada_w1_b"], t["hada_w2_a"], t["hada_w2_b"], alpha)
    if "diff" in t:
        if patch is not None:
            raise FileFormatError("both a low-rank patch and a full difference for one weight")
        patch = Full(t["diff"])
    return patch, t.get("diff_b")


def _config_alpha(cfg: dict | None):
    """module -> alpha from a peft config (diffusers' lora_adapter_metadata or adapter_config.json)."""
    def alpha(module: str, rank: int) -> float:
        if not cfg or cfg.get("lora_alpha") is None:
            return float(rank)
        for pat, a in (cfg.get("alpha_pattern") or {}).items():
            if module == pat or module.endswith("." + pat) or re.fullmatch(pat, module):
                return float(a)
        r = cfg.get("r") or rank
        for pat, rr in (cfg.get("rank_pattern") or {}).items():
            if module == pat or module.endswith("." + pat):
                r = rr
        # peft scales by lora_alpha / r; keep that scale for this module's actual rank
        return float(cfg["lora_alpha"]) * rank / r if r != rank else float(cfg["lora_alpha"])
    return alpha


def _dora_to_magnitude(lora: Lora, base: dict | None) -> None:
    """A ComfyUI/LyCORIS `dora_scale` on the output axis -> peft's magnitude, where the base weights are known
    (m = scale * ||W + dW|| / (||W|| + eps): what ComfyUI computes, in peft's terms)."""
    import torch

    for m, p in lora.weights.items():
        if not (isinstance(p, LowRank) and p.dora_scale is not None and p.magnitude is None and base):
            continue
        if p.dora_scale.shape[0] != p.B.shape[0] or m not in base:
            continue
        norm_w, norm_calc = p.row_norms(base[m])
        p.magnitude = (p.dora_scale.double().reshape(-1) * norm_calc
                       / (norm_w + torch.finfo(torch.float32).eps)).float()


def magnitude_to_dora_scale(p: LowRank, W) -> object:
    """peft's magnitude -> the output-axis `dora_scale` ComfyUI applies to the same effect (it divides by the
    unpatched weight's row norm: scale = m * (||W|| + eps) / ||W + dW||). Shape (out, 1), float32."""
    import torch

    norm_w, norm_calc = p.row_norms(W)
    return (p.magnitude.double().reshape(-1).to(norm_w.device) * (norm_w + torch.finfo(torch.float32).eps)
            / norm_calc).reshape(-1, 1).float().cpu()


def _check_finite(lora: Lora) -> None:
    """A LoRA with NaN or infinite values would turn every output black: refuse it, naming the module."""
    import math

    import torch

    for mod, p in list(lora.weights.items()) + list(lora.biases.items()):
        q = p.parent if isinstance(p, Rows) else p
        ts = [q] if torch.is_tensor(q) else [v for v in vars(q).values() if torch.is_tensor(v)]
        if not all(torch.isfinite(t).all() for t in ts) or not math.isfinite(getattr(q, "alpha", 0.0) or 0.0):
            raise FileFormatError(f"{mod} holds NaN or infinite values",
                                  "the training that wrote it diverged: use an earlier checkpoint")
