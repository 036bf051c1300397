"""How ComfyUI applies a LoRA file, restated (ComfyUI does not install from the package registry offline).

Each function mirrors one of ComfyUI's (Comfy-Org/ComfyUI, comfy/lora.py, comfy/weight_adapter/*.py,
comfy/utils.py; read at a125cd84 and its newer Kandinsky5/DiffSynth key-map branches):

- `key_map`        <- comfy.lora.model_lora_keys_unet (+ comfy.utils.flux_to_diffusers for FLUX's offsets)
- `load`           <- comfy.lora.load_lora and the adapters' `load` (LoRAAdapter, LoHaAdapter, LoKrAdapter)
- `calculate`      <- comfy.lora.calculate_weight and the adapters' `calculate_weight`, at strength 1
- `weight_decompose` <- comfy.weight_adapter.base.weight_decompose (DoRA; in `convert/patches.py`, which DoRA
  patches share)

ComfyUI patches a float32 copy of each weight (model_patcher.patch_weight_to_device), so the arithmetic here is
float64 on float32-exact inputs. Used by the tests (dense weights of tiny models) and by lorakit's check after
every save (probe vectors, any size).
"""

from __future__ import annotations

import re

from lorakit.convert.patches import weight_decompose
from lorakit.models.base import arch_adapter
from lorakit.models.native import flat, n_blocks, native_table, row_sizes, swap_halves

# comfy/weight_adapter/lora.py LoRAAdapter.load: (up, down) key suffixes, in the order it tries them
LORA_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
              (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
              (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
              (".lora_B.default.weight", ".lora_A.default.weight"))
HADA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
SWAP = "swap_scale_shift"  # comfy.utils.swap_scale_shift, the function ComfyUI applies to FLUX's final norm


def model_keys(arch: str, shapes: dict) -> dict:
    """The weights ComfyUI's model has ("diffusion_model.<native>.<param>") with their shapes, from the
    diffusers weights' shapes (fused rows added up). `shapes`: diffusers parameter name -> shape."""
    table = native_table(arch, n_blocks(shapes))
    out, seen = {}, set()
    for native, rec in table.items():
        for param, dparam in ((rec.param, "weight"), ("bias", "bias")):
            got = [shapes.get(f"{t}.{dparam}") for t in rec.targets]
            known = [g for g in got if g is not None]
            if not known:
                continue
            if len(known) < len(got):  # fused with projections the caller did not describe: their usual widths
                if dparam != "weight":
                    continue
                width = known[0][1]
                got = [g or ((4 * width, width) if rec.split == "qkv_mlp" and j == 3 else (width, width))
                       for j, g in enumerate(got)]
            rows = sum(g[0] for g in got)
            out[f"diffusion_model.{native}.{param}"] = (rows, *got[0][1:])
            seen.update(f"{t}.{dparam}" for t in rec.targets)
        weight, bias = f"diffusion_model.{native}.{rec.param}", f"diffusion_model.{native}.bias"
        if bias in out and weight not in out:  # a bias given alone: the model has its weight too (through whose
            out[weight] = out[bias]  # name ComfyUI finds `.diff_b`); its width is not known here
    for k, s in shapes.items():  # architectures whose native names are the diffusers names: everything else
        if k not in seen and (all(len(r.targets) == 1 and r.native == r.targets[0] for r in table.values())):
            out[f"diffusion_model.{k}"] = s
    return out


def key_map(arch: str, keys: dict) -> dict:
    """LoRA key prefix -> target: a weight key, or (weight key, (dim, start, length) | None, function name).

    Mirrors model_lora_keys_unet: every weight under "lora_unet_<native with _>" and "diffusion_model.<native>"
    (non-weight parameters under their own key); then the architecture's branch maps diffusers names under the
    prefixes it lists (`Adapter.comfy_diffusers_prefixes`) — for FLUX into the fused BFL weights by row offsets,
    and the final norm with swap_scale_shift (flux_to_diffusers' MAP_BASIC)."""
    out = {}
    for k in keys:
        if k.endswith(".weight"):
            out[f"lora_unet_{flat(k[len('diffusion_model.'):-len('.weight')])}"] = k
            out[k[:-len(".weight")]] = k
        else:
            out[k] = k
    for k in keys:  # FLUX's RMSNorm holds `scale` in ComfyUI's FLUX.1 model and `weight` where its FLUX.2 support
        if k.endswith(".scale"):  # made the norms comfy.ops layers: names written for either are read
            stem = k[:-len(".scale")]
            out.setdefault(stem, k)
            out.setdefault(f"lora_unet_{flat(stem[len('diffusion_model.'):])}", k)
    prefixes = arch_adapter(arch).comfy_diffusers_prefixes

    table = native_table(arch, n_blocks(keys))
    taken = takes_diffusers_name(arch)
    for native, rec in table.items():
        for param, dparam in ((rec.param, "weight"), ("bias", "bias")):
            key = f"diffusion_model.{native}.{param}"
            if key not in keys:
                continue
            rows = keys[key][0]
            sizes = row_sizes(rec, rows, keys[key][1] if len(keys[key]) > 1 else rows // max(len(rec.targets), 1)) \
                if len(rec.targets) > 1 else [rows]
            start = 0
            for t, n in zip(rec.targets, sizes, strict=True):
                if len(rec.targets) > 1:
                    target = (key, (0, start, n), None)
                elif rec.swap_halves:
                    target = (key, None, SWAP)
                else:
                    target = key
                start += n
                if dparam != "weight" or not taken(t):
                    continue  # ComfyUI maps diffusers names of weights only, and of those only the ones it lists
                for pre in prefixes:
                    if pre.endswith("_"):  # lycoris_, lora_transformer_: '_' for '.'
                        out[f"{pre}{flat(t)}"] = target
                    else:
                        out[f"{pre}{t}"] = target
    return out


def takes_diffusers_name(arch: str):
    """A test: does ComfyUI's key map for this architecture take a LoRA for this diffusers module name under its
    diffusers prefixes (`Adapter.comfy_diffusers_names`; every name when the architecture lists none)?"""
    a = arch_adapter(arch)
    names = a.comfy_diffusers_names
    if not a.comfy_diffusers_prefixes:  # Wan: ComfyUI's key map takes the original names only
        return lambda module: False
    if names is None:
        return lambda module: True
    pats = [re.compile(p) for p in names]
    return lambda module: any(p.search(module) for p in pats)


def load(sd: dict, kmap: dict) -> tuple[dict, set]:
    """(target -> patch, the keys it used). Mirrors load_lora: for each mapped prefix x, `x.alpha`, `x.dora_scale`,
    then the first adapter whose keys are present (LoRA, LoHa, LoKr), then `x.diff`, `x.diff_b`, `x.set_weight`."""
    patches, loaded = {}, set()
    for x, target in kmap.items():
        alpha = float(sd[f"{x}.alpha"]) if f"{x}.alpha" in sd else None
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        dora = sd.get(f"{x}.dora_scale")
        if dora is not None:
            loaded.add(f"{x}.dora_scale")
        for up, down in LORA_PAIRS:
            if f"{x}{up}" in sd:
                patches[target] = ("lora", sd[f"{x}{up}"], sd[f"{x}{down}"], alpha, dora)
                loaded.update({f"{x}{up}", f"{x}{down}"})
                break
        else:
            if f"{x}.hada_w1_a" in sd:
                patches[target] = ("loha", *(sd[f"{x}.{n}"] for n in HADA), alpha, dora)
                loaded.update(f"{x}.{n}" for n in HADA)
            elif any(f"{x}.{n}" in sd for n in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a")):
                patches[target] = ("lokr", *(sd.get(f"{x}.{n}") for n in LOKR), alpha, dora)
                loaded.update(f"{x}.{n}" for n in LOKR if f"{x}.{n}" in sd)
        if f"{x}.diff" in sd:
            patches[target] = ("diff", sd[f"{x}.diff"])
            loaded.add(f"{x}.diff")
        if f"{x}.diff_b" in sd and isinstance(target, str):
            # ComfyUI slices the target with [:-len(".weight")]: for a (key, offset) target that is a tuple slice,
            # which matches no weight, so a diffusers-named bias difference on a fused FLUX weight is not applied
            patches[target[: -len(".weight")] + ".bias"] = ("diff", sd[f"{x}.diff_b"])
            loaded.add(f"{x}.diff_b")
    return patches, loaded


def _diff(p) -> tuple:
    """(dense difference before alpha, alpha factor, dora scale) of one loaded patch."""
    import torch

    kind = p[0]
    f = [t.double() if t is not None and hasattr(t, "double") else t for t in p[1:]]
    if kind == "lora":
        up, down, alpha, dora = f
        return up.flatten(1) @ down.flatten(1), (alpha / down.shape[0] if alpha is not None else 1.0), dora
    if kind == "loha":
        w1a, w1b, w2a, w2b, alpha, dora = f
        return (w1a @ w1b) * (w2a @ w2b), (alpha / w1b.shape[0] if alpha is not None else 1.0), dora
    if kind == "lokr":
        w1, w2, w1a, w1b, w2a, w2b, alpha, dora = f
        dim = None
        if w1 is None:
            dim, w1 = w1b.shape[0], w1a @ w1b
        if w2 is None:
            dim, w2 = w2b.shape[0], w2a @ w2b
        return torch.kron(w1, w2), (alpha / dim if alpha is not None and dim is not None else 1.0), dora
    return f[0], 1.0, None  # diff


def calculate(weight, p, offset=None, function=None):
    """The patched weight (float64) from one loaded patch, as calculate_weight does at strength 1: on the rows
    `offset` selects, with `function` (swap_scale_shift) applied to the difference."""
    w = weight.double().clone()
    view = w.narrow(offset[0], offset[1], offset[2]) if offset is not None else w
    diff, alpha, dora = _diff(p)
    diff = (diff * alpha).reshape(view.shape)
    if function == SWAP:
        diff = swap_halves(diff)
    if dora is not None:
        view[:] = weight_decompose(dora.double(), view.clone(), diff)
    else:
        view += diff
    return w


def probe(p, x, rows: int, offset=None, function=None):
    """What `calculate` adds to a weight of `rows` rows, seen through probe columns x (float64, (cols, k)):
    (patched - weight) @ x, without forming the dense difference (a full-size layer's would be rows x cols in
    float64). For LoRA and plain-difference patches without DoRA on row offsets; None for the others (LoHa, LoKr,
    DoRA, conv kernels, column offsets), whose difference `calculate` must form."""
    import torch

    kind, x = p[0], x.double()
    if offset is not None and offset[0] != 0:
        return None
    if kind == "lora" and p[4] is None and p[1].dim() == 2 and p[2].dim() == 2:
        up, down, alpha = p[1].double(), p[2].double(), p[3]
        d = (up @ (down @ x)) * (alpha / down.shape[0] if alpha is not None else 1.0)
    elif kind == "diff" and p[1].dim() == 2:
        d = p[1].double() @ x
    else:
        return None
    if function == SWAP:
        d = swap_halves(d)
    out = torch.zeros(rows, x.shape[1], dtype=torch.float64)
    view = out.narrow(0, offset[1], offset[2]) if offset is not None else out
    view += d
    return out


def apply(sd: dict, arch: str, weights: dict) -> tuple[dict, set]:
    """ComfyUI's model weights after loading the LoRA `sd` (`weights`: "diffusion_model.<native>.<param>" ->
    tensor). Returns (the changed weights, the file's keys ComfyUI used)."""
    kmap = key_map(arch, {k: tuple(v.shape) for k, v in weights.items()})
    patches, loaded = load(sd, kmap)
    out = {}
    for target, p in patches.items():
        key, offset, function = (target, None, None) if isinstance(target, str) else target
        base = out.get(key, weights[key])
        out[key] = calculate(base, p, offset, function)
    return out, loaded
