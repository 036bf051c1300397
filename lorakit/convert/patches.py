"""What a LoRA-type file does to one weight of the model: the kinds lorakit reads, converts and applies.

Each kind gives its dense change `delta(W)` (float64; W, the base weight, is needed by DoRA only) and its
action on probe vectors `probe(x, W)` = delta(W) @ x, which for low-rank kinds never forms the dense matrix —
so a full-size LoRA is compared module by module in milliseconds.

- `LowRank(A, B, alpha)`: LoRA, delta = alpha/rank * B @ A. With `magnitude` (peft's DoRA: one magnitude per
  output row) W' = magnitude * (W + s B A) / ||W + s B A||_row; with `dora_scale` (ComfyUI's / LyCORIS' DoRA
  key), what ComfyUI computes from it (see `convert/comfy.py`).
- `LoKr(w1, w2, alpha)`: LyCORIS Kronecker product, delta = kron(w1, w2) (x alpha/dim when a factor is
  itself low-rank: w1 = w1_a @ w1_b, w2 = w2_a @ w2_b).
- `LoHa(w1a, w1b, w2a, w2b, alpha)`: LyCORIS Hadamard product, delta = (w1a @ w1b) * (w2a @ w2b) * alpha/rank.
- `Full(diff)`: a dense difference (ComfyUI's `.diff`, `.diff_b` for biases, norms).
- `Rows(parent, index)`: some rows of another patch's delta, in an order (one projection of a fused weight —
  FLUX's qkv — or FLUX's final-norm modulation whose two halves the original stores the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.errors import InputError


def _f64(t):
    return t.detach().to("cpu").double()


@dataclass
class LowRank:
    A: object  # (rank, in)
    B: object  # (out, rank)
    alpha: float
    magnitude: object | None = None  # peft DoRA: (out,)
    dora_scale: object | None = None  # ComfyUI/LyCORIS DoRA key: (out, 1) or (1, in)

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.B.shape[0]), int(self.A.shape[1])

    @property
    def dora(self) -> bool:
        return self.magnitude is not None or self.dora_scale is not None

    def lora_delta(self):
        return (_f64(self.B) @ _f64(self.A)) * self.scale

    def delta(self, W=None):
        d = self.lora_delta()
        if not self.dora:
            return d
        return dora_weight(W, d, self) - _f64(W)

    def row_norms(self, W):
        """(||W||_row, ||W + s B A||_row) in float64, without forming B @ A: ||W + sBA||² = ||W||²
        + 2s <W A^T, B>_row + s² <B (A A^T), B>_row (cheap for a full-size layer)."""
        W, A, B, s = _f64(W), _f64(self.A), _f64(self.B), self.scale
        w2 = (W * W).sum(1)
        n2 = w2 + 2 * s * ((W @ A.T) * B).sum(1) + s * s * ((B @ (A @ A.T)) * B).sum(1)
        return w2.sqrt(), n2.clamp(min=0).sqrt()

    def dora_factor(self, W):
        """The per-row factor f with W' = f * (W + s B A): magnitude / ||W + sBA|| (peft), or ComfyUI's
        dora_scale / (||W|| + eps) for an output-axis scale."""
        import torch

        norm_w, norm_calc = self.row_norms(W)
        if self.magnitude is not None:
            return _f64(self.magnitude).reshape(-1) / norm_calc
        if self.dora_scale.shape[0] == self.B.shape[0]:
            return _f64(self.dora_scale).reshape(-1) / (norm_w + torch.finfo(torch.float32).eps)
        return None  # an input-axis scale: only the dense form says it

    def probe(self, x, W=None):
        low = (_f64(self.B) @ (_f64(self.A) @ x)) * self.scale
        if not self.dora:
            return low
        if W is None:
            dora_weight(None, None, self)  # raises: the base weights are needed
        f = self.dora_factor(W)
        if f is None:
            return self.delta(W) @ x
        return (f - 1).reshape(-1, 1) * (_f64(W) @ x) + f.reshape(-1, 1) * low

    def folded(self) -> LowRank:
        """The same change with alpha = rank (alpha/rank multiplied into B): every consumer reads it alike,
        whether or not it reads alpha (ComfyUI ignores diffusers' metadata and takes alpha/rank = 1)."""

        import torch

        if self.alpha == self.rank:
            return self
        b = _f64(self.B) * self.scale
        same = b.to(self.B.dtype)  # in B's own dtype where that holds the product exactly; else in float32 (a
        b = same if torch.equal(same.double(), b) else b.float()  # 16-bit B scaled by 5/6 would lose ~1e-3)
        return LowRank(self.A, b.contiguous(), float(self.rank), self.magnitude, self.dora_scale)


def dora_weight(W, lora_delta, p: LowRank):
    """The weight a DoRA patch gives (float64), in the convention its magnitude is stored in."""

    if W is None:
        raise InputError("a DoRA LoRA's effect depends on the base weights, which were not given",
                         "pass the model (e.g. convert lora --model DIR)")
    W = _f64(W)
    calc = W + lora_delta
    if p.magnitude is not None:  # peft: norm of each output row of W + s B A
        return calc * (_f64(p.magnitude).reshape(-1, 1) / calc.norm(dim=1, keepdim=True))
    return weight_decompose(_f64(p.dora_scale), W, lora_delta)


def weight_decompose(dora_scale, weight, lora_diff):
    """ComfyUI's DoRA (float64, strength 1): with an output-axis scale the norm is the *unpatched* weight's
    (weight.reshape(out, -1).norm), with an input-axis scale the patched weight's column norm; eps of float32."""
    import torch

    calc = weight + lora_diff
    if dora_scale.shape[0] == calc.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
    else:
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1)
    norm = norm + torch.finfo(torch.float32).eps
    return calc * (dora_scale.reshape(norm.shape[0], -1) if dora_scale.dim() == 1 else dora_scale) / norm



@dataclass
class LoKr:
    w1: object | None = None
    w2: object | None = None
    alpha: float | None = None
    w1_a: object | None = None
    w1_b: object | None = None
    w2_a: object | None = None
    w2_b: object | None = None

    def _factors(self):
        w1 = _f64(self.w1) if self.w1 is not None else _f64(self.w1_a) @ _f64(self.w1_b)
        w2 = _f64(self.w2) if self.w2 is not None else _f64(self.w2_a) @ _f64(self.w2_b)
        return w1, w2

    @property
    def dim(self) -> int | None:
        """The rank of the factored factor (alpha divides by it), None when both factors are full."""
        if self.w2 is None and self.w2_b is not None:
            return int(self.w2_b.shape[0])
        if self.w1 is None and self.w1_b is not None:
            return int(self.w1_b.shape[0])
        return None

    @property
    def shape(self) -> tuple[int, int]:
        w1, w2 = self._factors()
        return int(w1.shape[0] * w2.shape[0]), int(w1.shape[1] * w2.shape[1])

    def delta(self, W=None):
        import torch

        w1, w2 = self._factors()
        d = torch.kron(w1, w2)
        scale = self.alpha / self.dim if (self.alpha is not None and self.dim) else 1.0
        return d * scale

    def probe(self, x, W=None):
        return self.delta() @ x


@dataclass
class LoHa:
    w1a: object
    w1b: object
    w2a: object
    w2b: object
    alpha: float | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.w1a.shape[0]), int(self.w1b.shape[1])

    def delta(self, W=None):
        d = (_f64(self.w1a) @ _f64(self.w1b)) * (_f64(self.w2a) @ _f64(self.w2b))
        return d * (self.alpha / self.w1b.shape[0] if self.alpha is not None else 1.0)

    def probe(self, x, W=None):
        return self.delta() @ x


@dataclass
class Full:
    diff: object

    @property
    def shape(self) -> tuple:
        return tuple(self.diff.shape)

    def delta(self, W=None):
        return _f64(self.diff)

    def probe(self, x, W=None):
        d = self.delta()
        return d @ x if d.dim() == 2 else d  # a 1-D difference (bias, norm scale) is compared as it is


@dataclass
class Rows:
    """Rows `index` (a list of row numbers, in order) of `parent`'s delta. Only for kinds whose delta needs no
    base weight (low-rank parents, DoRA included, are split exactly into low-rank pieces instead)."""

    parent: object
    index: list

    @property
    def shape(self) -> tuple:
        return (len(self.index), *self.parent.shape[1:])

    def delta(self, W=None):
        return self.parent.delta()[self.index]

    def probe(self, x, W=None):
        return self.parent.probe(x)[self.index]


KINDS = (LowRank, LoKr, LoHa, Full, Rows)


def kind_name(p) -> str:
    if isinstance(p, Rows):
        return kind_name(p.parent)
    if isinstance(p, LowRank):
        return "dora" if p.dora else "lora"
    return {LoKr: "lokr", LoHa: "loha", Full: "diff"}[type(p)]
