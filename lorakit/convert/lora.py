"""LoRA files in the layouts people use, converted exactly.

Every format is read into one canonical form — diffusers module name -> `Piece(A, B, alpha)`, whose effect on
the layer is `alpha / rank * B @ A` — and written from it. Formats:

- `diffusers`: `transformer.<module>.lora_A.weight` / `lora_B.weight`; alpha and rank in the file's
  `lora_adapter_metadata` (what `pipe.load_lora_weights` reads), else alpha = rank.
- `peft`: a folder with `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`) and
  `adapter_config.json` (r, lora_alpha, rank_pattern, alpha_pattern).
- `kohya` (sd-scripts): `lora_unet_<native name with _>.lora_down.weight` / `lora_up.weight` / `.alpha`.
- `comfyui`: `diffusion_model.<native name>.lora_A.weight` / `lora_B.weight` / `.alpha`.

"Native" names are the original checkpoints' module names, declared by each architecture's family adapter
(`Adapter.native_names`): for Qwen-Image and Kandinsky 5 the diffusers names; for FLUX the Black Forest Labs
names, whose fused projections (img_attn.qkv = to_q|to_k|to_v; single blocks' linear1 =
to_q|to_k|to_v|proj_mlp) are handled exactly: fusing stacks the A matrices and places the B matrices block-
diagonally (rank adds up, every delta is unchanged); splitting gives each projection its rows of B and, when B
is block-diagonal (as fusing made it), only its own columns — so a round trip returns the original tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import FileFormatError, InputError

FORMATS = ("diffusers", "peft", "kohya", "comfyui")


@dataclass
class Piece:
    A: object  # (rank, in)
    B: object  # (out, rank)
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self):
        return (self.B.double() @ self.A.double()) * self.scale


def _flat(name: str) -> str:
    return name.replace(".", "_")


# --------------------------------------------------------------------------- reading


def detect_format(keys) -> str:
    keys = list(keys)
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya"
    if any(k.startswith("diffusion_model.") for k in keys):
        return "comfyui"
    if any(k.startswith("base_model.model.") for k in keys):
        return "peft"
    if any(k.startswith("transformer.") and ".lora_A." in k for k in keys):
        return "diffusers"
    if any(".lora_A." in k or ".lora_down." in k for k in keys):
        return "peft"
    raise InputError("no LoRA weights in this file (no lora_A/lora_B or lora_down/lora_up keys)",
                     "is it a model checkpoint rather than a LoRA?")


def read(path, arch: str | None = None) -> tuple[dict[str, Piece], dict]:
    """Read a LoRA in any supported layout. Returns (pieces by diffusers module name, facts).

    Args:
        arch: the architecture (registry `arch`) when known; else it is told from the keys where they say it.

    Raises:
        InputError / FileFormatError: naming the file, for anything that is not a LoRA lorakit can read.
    """
    try:
        return _read(path, arch)
    except (FileFormatError, InputError) as e:
        if str(path) in e.message or type(e) not in (FileFormatError, InputError):
            raise
        raise type(e)(f"{path}: {e.message}", e.hint) from None


def _read(path, arch: str | None) -> tuple[dict[str, Piece], dict]:
    from lorakit.io import load, read_header
    from lorakit.models.base import guess_arch

    path = Path(path)
    config = None
    if path.is_dir():
        cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not weights.is_file():
            raise InputError(f"{path}: no adapter_model.safetensors (a peft adapter folder has one)")
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
        path = weights
    elif path.suffix.lower() in (".pt", ".pth", ".bin", ".ckpt"):
        raise InputError(f"{path}: pickled files are not read (loading them can run code)",
                         "convert it to .safetensors with the tool that wrote it")
    header = read_header(path)
    tensors = load(path, copy=True)
    if not tensors:
        raise InputError(f"{path}: the file holds no tensors")
    fmt = detect_format(tensors)
    meta = header.metadata or {}
    if fmt == "diffusers":
        pieces = _read_ab(tensors, "transformer.", _peft_alpha(meta))
    elif fmt == "peft":
        prefix = "base_model.model." if any(k.startswith("base_model.model.") for k in tensors) else ""
        pieces = _read_ab(tensors, prefix, _config_alpha(config))
    else:
        prefix = "lora_unet_" if fmt == "kohya" else "diffusion_model."
        native = _read_native(tensors, prefix, flat=fmt == "kohya")
        pieces = _from_native(native, arch or _native_arch(native, flat=fmt == "kohya"), flat=fmt == "kohya")
    _check_finite(path, pieces)
    guessed = guess_arch(pieces)
    if arch and guessed not in (None, arch):
        raise InputError(f"{path} is a {guessed} LoRA (its module names say so), not a {arch} one",
                         "use a LoRA trained for this model (or the right --family)")
    ranks = sorted({p.rank for p in pieces.values()})
    return pieces, {"format": fmt, "arch": arch or guessed, "modules": len(pieces), "ranks": ranks,
                    "dtype": str(next(iter(pieces.values())).A.dtype).removeprefix("torch.")}


def _check_finite(path, pieces: dict) -> None:
    """A LoRA with NaN or infinite values would turn every output black: refuse it, naming the module."""
    import math

    import torch

    for mod, p in pieces.items():
        if not (torch.isfinite(p.A).all() and torch.isfinite(p.B).all() and math.isfinite(p.alpha)):
            raise FileFormatError(f"{path}: {mod} holds NaN or infinite values",
                                  "the training that wrote it diverged: use an earlier checkpoint")


def _peft_alpha(meta: dict):
    """module -> alpha from diffusers' lora_adapter_metadata (rank/alpha patterns honoured)."""
    raw = meta.get("lora_adapter_metadata")
    cfg = {}
    if raw:
        try:
            cfg = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
        except ValueError:
            raise FileFormatError("lora_adapter_metadata is not JSON") from None
    return _config_alpha(cfg or None)


def _config_alpha(cfg: dict | None):
    def alpha(module: str, rank: int) -> float:
        if not cfg:
            return float(rank)
        for pat, a in (cfg.get("alpha_pattern") or {}).items():
            if module == pat or module.endswith("." + pat) or re.fullmatch(pat, module):
                return float(a)
        if cfg.get("lora_alpha") is None:
            return float(rank)
        r = cfg.get("r") or rank
        for pat, rr in (cfg.get("rank_pattern") or {}).items():
            if module == pat or module.endswith("." + pat):
                r = rr
        # peft scales by lora_alpha / r; keep that scale for this module's actual rank
        return float(cfg["lora_alpha"]) * rank / r if r != rank else float(cfg["lora_alpha"])
    return alpha


def _read_ab(tensors: dict, prefix: str, alpha_of) -> dict[str, Piece]:
    pieces = {}
    for k, a in tensors.items():
        if not k.endswith(".lora_A.weight"):
            continue
        mod = k.removeprefix(prefix).removesuffix(".lora_A.weight").replace(".default", "")
        bkey = k.replace(".lora_A.weight", ".lora_B.weight")
        if bkey not in tensors:
            raise FileFormatError(f"{k} has no matching lora_B")
        alpha_key = k.replace(".lora_A.weight", ".alpha")
        alpha = float(tensors[alpha_key]) if alpha_key in tensors else alpha_of(mod, a.shape[0])
        pieces[mod] = _checked(mod, a, tensors[bkey], alpha)
    orphans = [k for k in tensors if k.endswith(".lora_B.weight")
               and k.replace(".lora_B.weight", ".lora_A.weight") not in tensors]
    if orphans:
        raise FileFormatError(f"{orphans[0]} has no matching lora_A")
    return pieces


def _checked(mod, a, b, alpha) -> Piece:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise FileFormatError(f"{mod}: LoRA shapes do not fit (A {tuple(a.shape)}, B {tuple(b.shape)})",
                              "only Linear-layer LoRAs are supported (no conv / LoKr / LoHa)")
    return Piece(a, b, alpha)


def _read_native(tensors: dict, prefix: str, flat: bool) -> dict[str, Piece]:
    down, up = (".lora_down.weight", ".lora_up.weight")
    pieces = {}
    for k, a in tensors.items():
        for d, u in ((down, up), (".lora_A.weight", ".lora_B.weight")):
            if k.endswith(d):
                name = k.removeprefix(prefix).removesuffix(d)
                bk = k.removesuffix(d) + u
                if bk not in tensors:
                    raise FileFormatError(f"{k} has no matching {u.strip('.')}")
                ak = k.removesuffix(d) + ".alpha"
                alpha = float(tensors[ak]) if ak in tensors else float(a.shape[0])
                pieces[name] = _checked(name, a, tensors[bk], alpha)
    if any(k.startswith(("lora_te", "lora_te1_", "lora_te2_")) for k in tensors):
        raise InputError("this LoRA also trains a text encoder (lora_te* keys); lorakit converts transformer LoRAs",
                         "drop the text-encoder part first")
    return pieces


def _n_blocks(names) -> int:
    """1 + the largest block index in a list of module names (0 when none has one)."""
    idx = [int(m.group(1)) for n in names for m in [re.search(r"blocks[._](\d+)[._]", n)] if m]
    return max(idx) + 1 if idx else 0


def _native_map(arch: str, n_blocks: int, flat: bool = False) -> dict:
    """native name (kohya: with '_' for '.') -> its `NativeName` record, for the architecture's blocks."""
    from lorakit.models.base import arch_adapter

    table = arch_adapter(arch).native_table(n_blocks)
    return {_flat(k): v for k, v in table.items()} if flat else table


def _native_arch(native: dict, flat: bool) -> str:
    """The architecture whose native names these are (the one that knows all of them, else the most)."""
    from lorakit.models.registry import arch_names

    names = list(native)
    n = _n_blocks(names)
    known = {a: sum(1 for x in names if x in _native_map(a, n, flat)) for a in arch_names()}
    best = max(known, key=known.get)
    if not known[best]:
        raise InputError("cannot tell which model this LoRA is for from its keys", "pass --family")
    return best


def _from_native(native: dict, arch: str, flat: bool) -> dict[str, Piece]:
    table = _native_map(arch, _n_blocks(native), flat)
    out = {}
    unknown = [n for n in native if n not in table]
    if unknown:
        raise InputError(f"unknown {arch} module in this LoRA: {unknown[0]}"
                         + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""),
                         "is it for another model? (pass --family to say which)")
    for name, piece in native.items():
        rec = table[name]
        if rec.swap_halves:
            piece = Piece(piece.A, _swap_halves(piece.B), piece.alpha)
        if len(rec.targets) == 1:
            out[rec.targets[0]] = piece
        else:
            out.update(_split(piece, list(rec.targets), rec.split))
    return out


def _swap_halves(b):
    """Exchange the two halves of the output rows (FLUX's final norm: [scale, shift] <-> [shift, scale])."""
    import torch

    first, second = b.chunk(2, dim=0)
    return torch.cat([second, first], dim=0).contiguous()


def _chunks(targets: list[str], piece: Piece, split: str) -> list[int]:
    hidden = int(piece.A.shape[1])
    if split == "qkv_mlp":  # FLUX linear1: q, k, v (hidden each) then the MLP input
        return [hidden] * 3 + [int(piece.B.shape[0]) - 3 * hidden]
    n = int(piece.B.shape[0])
    if n % len(targets):
        raise FileFormatError(f"fused LoRA of {len(targets)} projections has {n} output rows")
    return [n // len(targets)] * len(targets)


def _split(piece: Piece, targets: list[str], split: str) -> dict[str, Piece]:
    import torch

    sizes = _chunks(targets, piece, split)
    if sum(sizes) != piece.B.shape[0] or min(sizes) <= 0:
        raise FileFormatError(f"fused LoRA rows {piece.B.shape[0]} do not split as {sizes}")
    rows = torch.split(piece.B, sizes, dim=0)
    cols = [torch.nonzero(r.abs().sum(0)).flatten() for r in rows]
    seen = torch.cat(cols) if cols else torch.empty(0, dtype=torch.long)
    block_diagonal = len(seen) == len(set(seen.tolist()))
    out = {}
    for t, r, c in zip(targets, rows, cols, strict=True):
        if len(c) == 0:
            continue  # this projection had no LoRA
        if block_diagonal:
            a, b = piece.A[c], r[:, c]
        else:
            a, b = piece.A, r
        out[t] = Piece(a.contiguous(), b.contiguous(), piece.scale * a.shape[0])
    return out


# --------------------------------------------------------------------------- writing


def _to_native(pieces: dict[str, Piece], arch: str) -> dict[str, Piece]:
    import torch

    table = _native_map(arch, _n_blocks(pieces))
    owner = {}
    for native, rec in table.items():
        for d in rec.targets:
            owner.setdefault(d, []).append(native)
    out = {}
    for mod in pieces:
        if mod not in owner:
            raise InputError(f"{mod} has no {arch} native name in this build", "keep the diffusers format")
    for native, rec in table.items():
        ds = list(rec.targets)
        present = [d for d in ds if d in pieces]
        if not present:
            continue
        if len(ds) == 1:
            p = pieces[ds[0]]
            out[native] = Piece(p.A, _swap_halves(p.B), p.alpha) if rec.swap_halves else p
            continue
        ps = [pieces.get(d) for d in ds]
        ref = next(p for p in ps if p is not None)
        scale = ref.scale
        same = all(p is None or abs(p.scale - scale) <= 1e-12 * abs(scale) for p in ps)
        hidden = int(ref.A.shape[1])
        sizes = [hidden] * 3 + [4 * hidden] if rec.split == "qkv_mlp" else [hidden] * len(ds)
        for j, p in enumerate(ps):
            if p is not None:
                sizes[j] = int(p.B.shape[0])
        a_parts, total = [], sum(p.rank for p in ps if p is not None)
        dtype = ref.A.dtype
        col = 0
        b = torch.zeros(sum(sizes), total, dtype=ref.B.dtype)
        row = 0
        for p, n in zip(ps, sizes, strict=True):
            if p is not None:
                a_parts.append(p.A)
                blk = p.B if same else (p.B.double() * (p.scale / scale)).to(p.B.dtype)
                b[row:row + n, col:col + p.rank] = blk
                col += p.rank
            row += n
        out[native] = Piece(torch.cat(a_parts).to(dtype), b, scale * total)
    return out


def write(pieces: dict[str, Piece], dst, fmt: str, arch: str | None, dtype=None,
          extra_metadata: dict | None = None) -> Path:
    """Write pieces in a format (atomically). Returns the written path."""
    import torch

    from lorakit.io import save

    if fmt not in FORMATS:
        raise InputError(f"--to must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dst = Path(dst)

    def cast(t):
        return t.to(dtype).contiguous() if dtype is not None else t.contiguous()

    meta = {"format": "pt", **(extra_metadata or {})}
    if fmt in ("diffusers", "peft"):
        prefix = "transformer." if fmt == "diffusers" else "base_model.model."
        sd, cfg = to_peft(pieces, prefix)
        sd = {k: cast(v) for k, v in sd.items()}
        if fmt == "diffusers":
            meta["lora_adapter_metadata"] = json.dumps({f"transformer.{k}": v for k, v in cfg.items()},
                                                       sort_keys=True)
            return save(sd, dst, metadata=meta)
        dst.mkdir(parents=True, exist_ok=True)
        save(sd, dst / "adapter_model.safetensors", metadata=meta)
        from lorakit.io import atomic_path

        with atomic_path(dst / "adapter_config.json") as tmp:
            Path(tmp).write_text(json.dumps({"peft_type": "LORA", **cfg}, indent=2, sort_keys=True))
        return dst
    if arch is None:
        from lorakit.models.registry import arch_names

        raise InputError("cannot tell which model this LoRA is for (attention-only keys are shared by several)",
                         f"pass --family (one of: {', '.join(arch_names())})")
    native = _to_native(pieces, arch)
    sd = {}
    for name, p in native.items():
        if fmt == "kohya":
            k = "lora_unet_" + _flat(name)
            sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = cast(p.A), cast(p.B)
        else:
            k = "diffusion_model." + name
            sd[f"{k}.lora_A.weight"], sd[f"{k}.lora_B.weight"] = cast(p.A), cast(p.B)
        sd[f"{k}.alpha"] = torch.tensor(p.alpha, dtype=torch.float32)
    return save(sd, dst, metadata=meta)


def to_peft(pieces: dict[str, Piece], prefix: str = "transformer.") -> tuple[dict, dict]:
    """(lora_A/lora_B state dict with `prefix`, the peft LoraConfig dict giving each module its rank and alpha)."""
    sd = {}
    for m, p in pieces.items():
        sd[f"{prefix}{m}.lora_A.weight"] = p.A
        sd[f"{prefix}{m}.lora_B.weight"] = p.B
    return sd, _peft_config(pieces)


def _peft_config(pieces: dict[str, Piece]) -> dict:
    """A peft LoraConfig dict that gives every module its rank and alpha (the commonest as defaults)."""
    from collections import Counter

    ranks = Counter(p.rank for p in pieces.values())
    r = ranks.most_common(1)[0][0]
    alphas = Counter(p.alpha for p in pieces.values() if p.rank == r)
    alpha = alphas.most_common(1)[0][0]
    rank_pattern = {m: p.rank for m, p in pieces.items() if p.rank != r}
    alpha_pattern = {m: p.alpha for m, p in pieces.items() if p.alpha != alpha}
    return {"r": r, "lora_alpha": alpha, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
            "target_modules": sorted(pieces), "lora_dropout": 0.0, "bias": "none", "use_dora": False,
            "init_lora_weights": True, "use_rslora": False}


def deltas_equal(a: dict[str, Piece], b: dict[str, Piece], rtol: float = 1e-6, probes: int = 8) -> tuple[bool, str]:
    """Do two LoRAs change every layer the same way? Compared through random probes (delta @ x), so a
    full-size layer's delta never has to be materialised."""
    import torch

    if set(a) != set(b):
        diff = sorted(set(a) ^ set(b))
        return False, f"modules differ: {diff[:3]}"
    g = torch.Generator().manual_seed(0)
    for m in a:
        pa, pb = a[m], b[m]
        if pa.B.shape[0] != pb.B.shape[0] or pa.A.shape[1] != pb.A.shape[1]:
            return False, f"{m}: shapes differ"
        x = torch.randn(pa.A.shape[1], probes, generator=g, dtype=torch.float64)
        ya = pa.B.double() @ (pa.A.double() @ x) * pa.scale
        yb = pb.B.double() @ (pb.A.double() @ x) * pb.scale
        err = float((ya - yb).norm() / ya.norm().clamp(min=1e-30))
        if err > rtol:
            return False, f"{m}: relative difference {err:.2e}"
    return True, "equal"
