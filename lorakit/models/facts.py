"""The small, plain records a family adapter fills in (no torch: config checks and --help read them).

Every family module declares these on its adapter class (see `base.Adapter.FACTS`); code outside
`lorakit/models/` asks the adapter and never keeps a table keyed by family name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraPresets:
    """Module names for `lora.targets` presets and `lora.train_io`.

    attention / mlp: suffixes of Linear modules inside the repeated blocks (`attention` = the attention
    projections, `attention_mlp` = both lists); io: exact top-level names of the layers between latents and
    blocks (patch embedder, final-norm modulation, output projection).
    """

    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    io: tuple[str, ...]


@dataclass(frozen=True)
class Published:
    """Published size of the full model, for the memory estimate when the model folder does not say."""

    hidden: int  # width of the repeated blocks
    blocks: int  # repeated blocks
    params: float  # transformer parameters
    text_tokens: int  # text length the estimate counts (the pipeline's usual maximum)
    source: str  # where the figures come from
    working_set: float = 16.0  # bf16 values per token x hidden unit one block keeps for backward (calibrated)
    working_set_uncompiled: float | None = None  # the same where the blocks run uncompiled (None: the compiled
    # figure x UNCOMPILED; measured where a family keeps more)

    @property
    def uncompiled(self) -> float:
        """What one block keeps for backward where the blocks run uncompiled (memory.compile off, block swapping,
        FSDP): eager PyTorch keeps intermediates that the compiled blocks fuse away."""
        return self.working_set_uncompiled or self.working_set * UNCOMPILED


UNCOMPILED = 1.25  # uncompiled over compiled blocks' working set: FLUX.1-dev 1024² on an H100, 47.3 GiB against 42.0


@dataclass(frozen=True)
class NativeName:
    """One module of the original (Black Forest Labs / ComfyUI / kohya) checkpoint and the diffusers modules it
    holds. `{i}` stands for the block index in both names.

    split: how a fused weight's output rows divide among `targets` — "equal", or "qkv_mlp" (q, k, v of the
    input width each, then the MLP input: FLUX single blocks' linear1).
    swap_halves: the original stores the two halves of the output rows in the other order (FLUX's final
    norm: [scale, shift] where diffusers has [shift, scale]).
    """

    native: str
    targets: tuple[str, ...]
    split: str = "equal"
    swap_halves: bool = False
    param: str = "weight"  # the original's name for what diffusers calls `weight` (FLUX's RMSNorms: "scale")


@dataclass(frozen=True)
class AttentionCase:
    """A bare attention shape the doctor's self-test runs with every SDPA backend (forward and backward).

    layout "joint": the output feeds its own projection (dual-stream blocks); "single": it is concatenated with
    an MLP branch before one projection (FLUX's single-stream blocks), so its gradient is a strided slice.
    """

    name: str
    seq: int
    masked: bool
    layout: str = "joint"
    head_dim: int = 128
    heads: int = 24
