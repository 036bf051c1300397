"""After every save: the file read back the way each consumer reads it, against what was trained.

- diffusers: the family pipeline's own `lora_state_dict` (its key conversions) and the peft config diffusers
  builds from the file's `lora_adapter_metadata` (rank and alpha per module, by peft's own pattern matching);
- ComfyUI: `convert/comfy.py`'s restatement of its key map and loader, into the original (native) weights.

Each view's change of every weight is compared with the trained one through random probe vectors (cheap at
any size); DoRA needs the base weights. Returns one line per consumer ("equal" or where it differs).
"""

from __future__ import annotations

from pathlib import Path

from lorakit.convert import comfy
from lorakit.convert.compare import low_rank, one_thread
from lorakit.convert.lora import Lora, deltas_equal
from lorakit.convert.patches import LoHa, LoKr, LowRank
from lorakit.io import load
from lorakit.models.base import family_adapter
from lorakit.models.native import n_blocks, native_table, row_sizes, swap_halves
from lorakit.models.registry import family_info


def trained(transformer) -> Lora:
    """The LoRA as it lives in a peft-wrapped transformer (A, B, scaling, DoRA magnitudes), read from the
    modules themselves — not from any file."""
    out = Lora()
    for name, mod in transformer.named_modules():
        lyco = _lycoris(mod)
        if lyco is not None:
            out.weights[name] = lyco
            continue
        a = getattr(mod, "lora_A", None)
        if a is None or not hasattr(a, "keys") or "default" not in a.keys():
            continue
        A, B = mod.lora_A["default"].weight.detach().float().cpu(), mod.lora_B["default"].weight.detach().float().cpu()
        alpha = float(mod.scaling["default"]) * A.shape[0]
        mags = getattr(mod, "lora_magnitude_vector", None)
        mag = mags["default"].weight.detach().float().cpu() if mags is not None and "default" in mags.keys() else None
        out.weights[name] = LowRank(A, B, alpha, mag)
    return out


def _lycoris(mod):
    """A peft LoKr / LoHa layer as its LyCORIS patch, peft's scale (alpha / r) folded into one factor so that
    the file needs no alpha: every reader applies the same delta. None for other modules."""
    def has(n):
        return "default" in (getattr(mod, n, None) or {})

    def get(n):
        return getattr(mod, n)["default"].detach().float().cpu() if has(n) else None

    if has("lokr_w1") or has("lokr_w1_a"):
        s = float(mod.scaling["default"])
        f = {n: get(f"lokr_{n}") for n in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b")}
        scaled = "w2" if f["w2"] is not None else "w2_b"
        f[scaled] = f[scaled] * s  # a new tensor: on the CPU in fp32, `get` returns the parameter's own data
        return LoKr(f["w1"], f["w2"], None, f["w1_a"], f["w1_b"], f["w2_a"], f["w2_b"])
    if has("hada_w1_a"):
        s = float(mod.scaling["default"])
        return LoHa(get("hada_w1_a") * s, get("hada_w1_b"), get("hada_w2_a"), get("hada_w2_b"), None)
    return None


def base_weights(transformer, modules) -> dict:
    """module -> its frozen base weight (the peft base layer's; an fp8 layer dequantized), float32, where it
    lives. Empty when a layer is stored in 4 bits (the DoRA comparison is then skipped, and says so)."""
    import torch

    layers = {}
    for name, mod in transformer.named_modules():
        if name not in modules:
            continue
        layer = getattr(mod, "base_layer", mod)
        dt = layer.weight.dtype
        if not (dt in (torch.float32, torch.bfloat16, torch.float16)
                or (dt == torch.float8_e4m3fn and hasattr(layer, "scale"))):
            return {}
        layers[name] = layer
    return _Weights(layers)


class _Weights(dict):
    """module -> base weight, read from the layer when asked (no full-size copy of every weight at once)."""

    def __init__(self, layers: dict):
        super().__init__()
        self.layers = layers

    def __contains__(self, k):
        return k in self.layers

    def __getitem__(self, k):
        layer = self.layers[k]
        w = layer.weight.detach()
        return w.float() * layer.scale.float()[:, None] if hasattr(layer, "scale") and w.element_size() == 1 else w

    def get(self, k, default=None):
        return self[k] if k in self.layers else default

    def keys(self):
        return self.layers.keys()

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def __bool__(self):
        return bool(self.layers)

    def items(self):
        return ((k, self[k]) for k in self.layers)


def module_shapes(transformer) -> dict:
    """diffusers parameter name -> shape, of every Linear weight (peft's wrappers seen through)."""
    import torch

    out = {}
    for name, mod in transformer.named_modules():
        layer = getattr(mod, "base_layer", None)
        if isinstance(layer, torch.nn.Linear):
            out[f"{name}.weight"] = tuple(layer.weight.shape)
        elif isinstance(mod, torch.nn.Linear) and not name.endswith(".base_layer") and ".lora_" not in name:
            out[f"{name}.weight"] = tuple(mod.weight.shape)
    return out


def diffusers_view(path: Path, family: str) -> Lora:
    """The file as diffusers loads it: the pipeline's lora_state_dict + the peft config from its metadata."""
    from peft.utils.other import get_pattern_key

    cls = family_adapter(family).pipeline_class()
    got = cls.lora_state_dict(str(path), return_lora_metadata=True)
    sd, meta = got[0], got[-1]
    sd = {k.removeprefix("transformer."): v for k, v in sd.items() if k.startswith("transformer.")}
    meta = {k.removeprefix("transformer."): v for k, v in (meta or {}).items() if k.startswith("transformer.")}
    out = Lora()
    for k, a in sd.items():
        if not k.endswith(".lora_A.weight"):
            continue
        m = k.removesuffix(".lora_A.weight")
        rank = int(a.shape[0])
        if meta:
            r = meta.get("rank_pattern", {}).get(get_pattern_key(meta.get("rank_pattern", {}).keys(), m),
                                                 meta.get("r", rank))
            alpha = meta.get("alpha_pattern", {}).get(get_pattern_key(meta.get("alpha_pattern", {}).keys(), m),
                                                      meta.get("lora_alpha", r))
            scale = alpha / r
        else:
            scale = 1.0  # no metadata and no alphas: diffusers' convention is alpha == rank
        mag = sd.get(f"{m}.lora_magnitude_vector")
        out.weights[m] = LowRank(a.float(), sd[f"{m}.lora_B.weight"].float(), scale * rank,
                                 None if mag is None else mag.float().reshape(-1))
    return out


def comfy_probe_check(path: Path, arch: str, expected: Lora, base: dict | None, rtol: float,
                      shapes: dict | None = None) -> str:
    """The file through ComfyUI's rules, compared in the original (native) weights with `expected` (`shapes`:
    the model's weight shapes, for fused weights whose other projections the LoRA leaves alone)."""
    with one_thread(not base and low_rank(expected.weights.values())):
        return _comfy_probe_check(path, arch, expected, base, rtol, shapes)


def _comfy_probe_check(path, arch, expected, base, rtol, shapes) -> str:
    import torch

    sd = load(path, copy=True)
    native_only = _native_only(sd, arch, expected)
    if native_only:  # ComfyUI reads these modules under their native names only: compare the others
        expected = Lora({m: p for m, p in expected.weights.items() if m not in native_only}, expected.biases)
        sd = {k: v for k, v in sd.items() if not any(k.startswith(f"transformer.{m}.") for m in native_only)}
    shapes = dict(shapes or {})
    shapes.update({f"{m}.weight": tuple(p.shape) for m, p in expected.weights.items()})
    shapes.update({f"{m}.bias": tuple(b.shape) for m, b in expected.biases.items()})  # a bias without a weight patch
    if base:
        shapes.update({f"{m}.weight": tuple(w.shape) for m, w in base.items()})
    keys = comfy.model_keys(arch, shapes)
    patches, loaded = comfy.load(sd, comfy.key_map(arch, keys))

    # what ComfyUI does to each native weight, through probes, against the expected modules' rows

    g = torch.Generator().manual_seed(0)
    for native, rec in native_table(arch, n_blocks(shapes)).items():
        key = f"diffusion_model.{native}.{rec.param}"
        if key not in keys or not any(t in expected.weights for t in rec.targets) or len(keys[key]) != 2:
            continue
        rows, cols = keys[key]
        x = torch.randn(cols, 4, generator=g, dtype=torch.float64)
        sizes = row_sizes(rec, rows, cols) if len(rec.targets) > 1 else [rows]
        parts = []
        for t, n in zip(rec.targets, sizes, strict=True):
            p = expected.weights.get(t)
            parts.append(p.probe(x, base[t] if base and t in base else None) if p is not None
                         else torch.zeros(n, 4, dtype=torch.float64))
        want = torch.cat(parts)
        if rec.swap_halves:
            want = swap_halves(want)
        Wn = _native_base(native, arch, base, rows, cols) if base else None
        got = torch.zeros(rows, 4, dtype=torch.float64)
        for target, q in patches.items():
            k2, offset, function = (target, None, None) if isinstance(target, str) else target
            if k2 != key:
                continue
            d = comfy.probe(q, x, rows, offset, function) if Wn is None else None  # DoRA reads the base
            if d is None:  # the dense difference, as ComfyUI forms it
                W = Wn if Wn is not None else torch.zeros(rows, cols, dtype=torch.float64)
                d = (comfy.calculate(W, q, offset, function) - W) @ x
            got += d
        err = float((got - want).norm() / want.norm().clamp(min=1e-30))
        if err > rtol:
            return f"{native}: relative difference {err:.2e}"
    # peft's DoRA magnitudes are for diffusers; ComfyUI reads the `dora_scale` written beside them (and logs the
    # magnitude keys as not loaded, harmlessly)
    unused = [k for k in sd if k not in loaded and not (k.endswith(".lora_magnitude_vector")
                                                          and k.replace(".lora_magnitude_vector", ".dora_scale") in sd)]
    if unused:
        return f"{len(unused)} key(s) ComfyUI would not load, e.g. {unused[0]}"
    if native_only and not expected.weights:
        return (f"{PARTIAL} it takes none of the {len(native_only)} module(s) of this file under their diffusers "
                f"names, only by their native names (e.g. {native_only[0]}). `lorakit convert FILE --to comfyui` "
                "writes a file ComfyUI reads whole")
    if native_only:
        return (f"{PARTIAL} it skips {len(native_only)} module(s) of this file, which it takes by their native names "
                f"only (e.g. {native_only[0]}); the other {len(expected.weights)} equal. `lorakit convert FILE "
                "--to comfyui` writes a file ComfyUI reads whole")
    return "equal"


PARTIAL = "ComfyUI reads part of it:"  # a consumer check's answer: the file is right, one reader applies only part


def consumer_note(path, checks: dict | None) -> str | None:
    """The warning a save or conversion says in its normal output when a consumer reads only part of the file
    (None when each reads it whole or was not compared)."""
    part = next((v for v in (checks or {}).values() if v.startswith(PARTIAL)), None)
    return f"{path}: {part.replace('FILE', str(path))}" if part else None


def _native_only(sd: dict, arch: str, expected: Lora) -> list[str]:
    """The file's diffusers-named modules ("transformer.<module>.") that ComfyUI's key map does not take under
    that name for this architecture."""
    taken = comfy.takes_diffusers_name(arch)
    return [m for m in expected.weights if not taken(m) and any(k.startswith(f"transformer.{m}.") for k in sd)]


def _native_base(native: str, arch: str, base: dict, rows: int, cols: int):
    """The original (fused) base weight of a native module from the diffusers weights; projections whose weight
    is not given are zero rows (ComfyUI's row-offset patches of the others never read them)."""
    import torch

    rec = native_table(arch, n_blocks(base)).get(native)
    if rec is None:
        return base[native].double() if native in base else None
    sizes = row_sizes(rec, rows, cols) if len(rec.targets) > 1 else [rows]
    parts = [base[t].double().cpu() if t in base else torch.zeros(n, cols, dtype=torch.float64)
             for t, n in zip(rec.targets, sizes, strict=True)]
    w = torch.cat(parts)
    return swap_halves(w) if rec.swap_halves else w


def _diffusers_check(path, family, expected, base, rtol, dora) -> str:
    try:
        view = diffusers_view(path, family)
        ok, why = deltas_equal(expected.weights, view.weights, rtol=rtol, base=base)
        return why if ok or not (dora and not base) else "not compared: DoRA needs the base weights"
    except Exception as e:  # noqa: BLE001 - the check reports, it does not stop the run
        return f"not readable by diffusers: {type(e).__name__}: {str(e)[:160]}"


def check_file(path: Path, family: str, expected: Lora, base: dict | None = None, rtol: float = 1e-5,
               shapes: dict | None = None) -> dict:
    """{"diffusers": ..., "comfyui": ...}: each consumer's reading of the file against `expected`."""
    out = {}
    dora = any(getattr(p, "dora", False) for p in expected.weights.values())
    if any(isinstance(p, (LoKr, LoHa)) for p in expected.weights.values()):
        out["diffusers"] = "not compared: diffusers loads LoRA/DoRA only (LoKr/LoHa: ComfyUI, peft, lorakit infer)"
    else:
        out["diffusers"] = _diffusers_check(path, family, expected, base, rtol, dora)
    if dora and not base:
        out["comfyui"] = "not compared: DoRA needs the base weights"
        return out
    try:
        out["comfyui"] = comfy_probe_check(path, family_info(family).arch, expected, base, rtol, shapes)
    except Exception as e:  # noqa: BLE001
        out["comfyui"] = f"check failed: {type(e).__name__}: {str(e)[:160]}"
    return out
