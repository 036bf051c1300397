"""Native (original / ComfyUI / kohya) module names <-> diffusers module names, for every patch kind.

The names are each architecture's facts (`Adapter.native_names`). For Qwen-Image and Kandinsky 5 they are the
diffusers names. FLUX's Black Forest Labs names fuse projections (img_attn.qkv = to_q|to_k|to_v; single blocks'
linear1 = to_q|to_k|to_v|proj_mlp) and store the final norm's modulation halves the other way round; all are
handled exactly:

- low-rank patches fuse by stacking the A matrices and placing the B matrices block-diagonally (the rank adds
  up, every delta is unchanged; different alphas are folded into B) and split by giving each projection its rows
  of B — and, when B is block-diagonal (as fusing made it), only its own columns — so round trips return the
  original tensors; DoRA magnitudes (one per output row) split and fuse with their rows;
- other patches (LoKr, LoHa, full differences) split into `Rows` views of the fused patch and fuse back to it;
- biases split and fuse by rows; swapped halves are swapped back.
"""

from __future__ import annotations

from lorakit.convert.patches import LowRank, Rows
from lorakit.errors import FileFormatError, InputError
from lorakit.models.base import arch_adapter
from lorakit.models.native import flat, identity_arch, n_blocks, native_table, row_sizes, swap_halves
from lorakit.models.registry import arch_names


def diffusers_table(arch: str, blocks: int, flat_names: bool = False) -> dict[str, str]:
    """diffusers module name (or its '_' form) -> itself, for every module the architecture's tables know."""
    names = {t for rec in native_table(arch, blocks).values() for t in rec.targets}
    return {(flat(n) if flat_names else n): n for n in names}


def guess_native_arch(names, flat_names: bool, shapes: dict | None = None) -> str:
    """The architecture whose native names these are (the one that knows all of them, else the most). Where
    several know as many (FLUX.1 and FLUX.2 share their original names), the fused layers' shapes decide
    (`Adapter.native_fused_ratios`: rows per input column of a fused weight); the first otherwise."""
    names = list(names)
    n = n_blocks(names)
    known = {a: sum(1 for x in names if x in native_table(a, n, flat_names)) for a in arch_names()}
    best = max(known, key=known.get)
    if not known[best]:
        raise InputError("cannot tell which model this LoRA is for from its keys", "pass --family")
    tied = [a for a in known if known[a] == known[best]]
    if len(tied) > 1 and shapes:
        def fits(a):
            ratios = {(flat(k) if flat_names else k): r for k, r in arch_adapter(a).native_fused_ratios.items()}
            seen = [(ratios[s], shape) for m, shape in shapes.items() for s in ratios if m.endswith(s)]
            return bool(seen) and all(rows == r * cols for r, (rows, cols) in seen)

        fitting = [a for a in tied if fits(a)]
        if len(fitting) == 1:
            return fitting[0]
    return best


# --------------------------------------------------------------------------- native -> diffusers


def _swap_index(n: int) -> list:
    return list(range(n // 2, n)) + list(range(n // 2))


def split_patch(p, rec) -> dict:
    """A patch of a native module -> patches of its diffusers modules."""
    if rec.swap_halves:
        p = LowRank(p.A, swap_halves(p.B), p.alpha, _swap_opt(p.magnitude), _swap_opt(p.dora_scale)) \
            if isinstance(p, LowRank) else Rows(p, _swap_index(p.shape[0]))
    if len(rec.targets) == 1:
        return {rec.targets[0]: p}
    sizes = row_sizes(rec, p.shape[0], p.shape[1])
    if sum(sizes) != p.shape[0] or min(sizes) <= 0:
        raise FileFormatError(f"{rec.native}: fused rows {p.shape[0]} do not split as {sizes}")
    if isinstance(p, LowRank):
        return _split_low_rank(p, list(rec.targets), sizes)
    out, start = {}, 0
    for t, n in zip(rec.targets, sizes, strict=True):
        out[t] = Rows(p, list(range(start, start + n)))
        start += n
    return out


def _swap_opt(t):
    return None if t is None or t.shape[0] == 1 else swap_halves(t)


def _split_low_rank(p: LowRank, targets: list[str], sizes: list[int]) -> dict:
    import torch

    if p.dora_scale is not None and p.dora_scale.shape[0] == 1:
        raise FileFormatError("a DoRA scale over the input axis cannot be split into the fused projections",
                              "convert from the file's own layout")
    rows = torch.split(p.B, sizes, dim=0)
    cols = [torch.nonzero(r.abs().sum(0)).flatten() for r in rows]
    seen = torch.cat(cols) if cols else torch.empty(0, dtype=torch.long)
    block_diagonal = len(seen) == len(set(seen.tolist()))
    mags = torch.split(p.magnitude, sizes) if p.magnitude is not None else [None] * len(sizes)
    scales = torch.split(p.dora_scale, sizes) if p.dora_scale is not None else [None] * len(sizes)
    out = {}
    for t, r, c, m, d in zip(targets, rows, cols, mags, scales, strict=True):
        if len(c) == 0:
            continue  # this projection had no LoRA
        a, b = (p.A[c], r[:, c]) if block_diagonal else (p.A, r)
        out[t] = LowRank(a.contiguous(), b.contiguous(), p.scale * a.shape[0],
                         None if m is None else m.contiguous(), None if d is None else d.contiguous())
    return out


def split_bias(b, rec, in_features: int | None = None) -> dict:
    """A bias difference of a native module -> its diffusers modules' rows."""
    if rec.swap_halves:
        b = swap_halves(b)
    if len(rec.targets) == 1:
        return {rec.targets[0]: b}
    if in_features is None and rec.split == "qkv_mlp":
        raise FileFormatError(f"{rec.native}: its bias difference cannot be split without the layer's width")
    sizes = row_sizes(rec, b.shape[0], in_features or 0)
    out, start = {}, 0
    for t, n in zip(rec.targets, sizes, strict=True):
        out[t] = b[start:start + n].contiguous()
        start += n
    return out


# --------------------------------------------------------------------------- diffusers -> native


def swapped_modules(arch: str | None, blocks: int) -> set[str]:
    """The diffusers modules whose original weight holds its two halves of rows the other way round (FLUX's final
    norm). A `dora_scale` key names the original weight's rows (ComfyUI applies it there, after swapping the
    difference: comfy/weight_adapter/base.weight_decompose), so under a diffusers name it is stored swapped too."""
    if arch is None:
        return set()
    return {rec.targets[0] for rec in native_table(arch, blocks).values() if rec.swap_halves and len(rec.targets) == 1}


def dora_scale_order(p, module: str, swapped: set[str]):
    """A LowRank's dora_scale between diffusers' row order and the original's (the same swap both ways)."""
    if module in swapped and p.dora_scale is not None and p.dora_scale.shape[0] == p.B.shape[0]:
        return LowRank(p.A, p.B, p.alpha, p.magnitude, swap_halves(p.dora_scale))
    return p


def owners(arch: str, blocks: int) -> dict[str, str]:
    """diffusers module name -> the native module holding it."""
    return {t: native for native, rec in native_table(arch, blocks).items() for t in rec.targets}


def fuse_patches(patches: dict, arch: str, widths: dict | None = None, base: dict | None = None) -> dict:
    """Patches by diffusers name -> patches by native name (fused where the original fuses).

    Args:
        widths: diffusers module -> its output rows, for fused weights whose other projections have no patch
            (the base model's shapes; without them FLUX's widths are assumed: q/k/v the input width, MLP 4x).
        base: diffusers module -> base weight: DoRA on some projections of a fused weight is written with the
            identity scale (||W|| + eps, ComfyUI's convention) on the others' rows.
    """
    table = native_table(arch, n_blocks(patches))
    own = owners(arch, n_blocks(patches))
    if not identity_arch(arch):
        unknown = [m for m in patches if m not in own]
        if unknown:
            raise InputError(f"{unknown[0]} has no {arch} native name in this build", "keep the diffusers format")
    out = {m: p for m, p in patches.items() if m not in own}  # identity architectures: any name is native
    for native, rec in table.items():
        present = [t for t in rec.targets if t in patches]
        if not present:
            continue
        if len(rec.targets) == 1:
            p = patches[rec.targets[0]]
            out[native] = _unswap(p) if rec.swap_halves else p
            continue
        out[native] = _fuse(native, rec, patches, widths, base)
    return out


def _unswap(p):
    if isinstance(p, LowRank):
        return LowRank(p.A, swap_halves(p.B), p.alpha, _swap_opt(p.magnitude), _swap_opt(p.dora_scale))
    if isinstance(p, Rows) and p.index == _swap_index(p.parent.shape[0]):
        return p.parent
    return Rows(p, _swap_index(p.shape[0]))


def _fuse(native: str, rec, patches: dict, widths: dict | None, base: dict | None = None):
    import torch

    ps = [patches.get(t) for t in rec.targets]
    given = [p for p in ps if p is not None]
    parents = {id(p.parent) for p in given if isinstance(p, Rows)}
    if len(parents) == 1 and all(isinstance(p, Rows) for p in given) and len(given) == len(ps):
        return given[0].parent  # the views a split made: the original fused patch
    if not all(isinstance(p, LowRank) for p in given):
        kinds = sorted({type(p).__name__ for p in given})
        if kinds in (["LoKr"], ["LoHa"]):
            raise InputError(f"{native}: {kinds[0]} patches on {', '.join(rec.targets)} do not combine into one "
                             f"{kinds[0]} of the fused weight the native layout has",
                             "keep the diffusers-named file (lorakit's default): ComfyUI maps those names onto "
                             "its fused weights")
        raise InputError(f"{native}: its projections carry different kinds of patches; the original layout "
                         "fuses them into one weight", "keep the diffusers format")
    ref = given[0]
    hidden = int(ref.A.shape[1])
    sizes = [hidden] * 3 + [4 * hidden] if rec.split == "qkv_mlp" else [hidden] * len(ps)
    for j, (t, p) in enumerate(zip(rec.targets, ps, strict=True)):
        if p is not None:
            sizes[j] = int(p.B.shape[0])
        elif widths and t in widths:
            sizes[j] = int(widths[t])
    dora = [p.dora for p in given]
    partial = any(dora) and (not all(dora) or len(given) < len(ps))
    if partial and not (base and all(t in base for t in rec.targets)):
        raise InputError(f"{native}: DoRA on some of its fused projections only is written fused with the base "
                         "weights", "pass the model (--model DIR), or keep the diffusers format")
    scale = ref.scale
    same = all(abs(p.scale - scale) <= 1e-12 * abs(scale) for p in given)
    total = sum(p.rank for p in given)
    b = torch.zeros(sum(sizes), total, dtype=ref.B.dtype)
    a_parts, row, col = [], 0, 0
    for p, n in zip(ps, sizes, strict=True):
        if p is not None:
            a_parts.append(p.A)
            blk = p.B if same else (p.B.double() * (p.scale / scale)).to(p.B.dtype)
            b[row:row + n, col:col + p.rank] = blk
            col += p.rank
        row += n
    mag = ds = None
    if any(dora) and not partial and all(p.magnitude is not None for p in given):
        mag = torch.cat([p.magnitude for p in given])
    if any(dora) and (partial or all(p.dora_scale is not None for p in given)):
        eps = torch.finfo(torch.float32).eps  # rows without DoRA: ComfyUI's identity scale, ||W|| + eps
        ds = torch.cat([p.dora_scale.reshape(-1, 1).float() if p is not None and p.dora_scale is not None
                        else (base[t].double().norm(dim=1) + eps).reshape(-1, 1).float()
                        for t, p in zip(rec.targets, ps, strict=True)])
    return LowRank(torch.cat(a_parts).to(ref.A.dtype), b, scale * total, mag, ds)


def fuse_biases(biases: dict, arch: str, widths: dict | None = None) -> dict:
    """Bias differences by diffusers name -> by native name (rows concatenated; missing rows zero)."""
    import torch

    if not biases:
        return {}
    table = native_table(arch, n_blocks(biases))
    own = owners(arch, n_blocks(biases))
    out = {m: b for m, b in biases.items() if m not in own}
    for native, rec in table.items():
        present = [t for t in rec.targets if t in biases]
        if not present:
            continue
        if len(rec.targets) == 1:
            b = biases[rec.targets[0]]
            out[native] = swap_halves(b) if rec.swap_halves else b
            continue
        if len(present) < len(rec.targets) and not widths:
            raise InputError(f"{native}: bias differences for only some of its fused projections",
                             "keep the diffusers format")
        parts = [biases[t] if t in biases else torch.zeros(int(widths[t]), dtype=biases[present[0]].dtype)
                 for t in rec.targets]
        out[native] = torch.cat(parts)
    return out
