"""Model components built on the meta device and filled from `lorakit.io.load` (assign: no second copy,
no fp32 detour).

`load_component(folder)` reads `config.json`, builds the diffusers or transformers class with empty
(meta) parameters, loads the weights straight onto the target device in the target dtype, and assigns
them. Buffers and plain tensor attributes computed in `__init__` (rotary tables, position ids) are
built normally, not on meta, so nothing is left unmaterialised. Parameters a class keeps in fp32
(`_keep_in_fp32_modules`) stay fp32. Where a checkpoint's key names need the library's own conversion
(older transformers layouts), transformers converts the tensors lorakit read.
"""

from __future__ import annotations

import json
from pathlib import Path

from lorakit.errors import FileFormatError, InputError
from lorakit.io.header import read_header
from lorakit.io.reader import load, resolve_files


def _class_of(folder: Path):
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise InputError(f"{folder}: no readable config.json",
                         "point at a component folder, e.g. .../transformer") from None
    if "_class_name" in cfg:
        import diffusers

        return "diffusers", getattr(diffusers, cfg["_class_name"], None), cfg["_class_name"]
    arch = (cfg.get("architectures") or [None])[0]
    if arch:
        import transformers

        return "transformers", getattr(transformers, arch, None), arch
    raise FileFormatError(f"{folder}/config.json names no class (_class_name or architectures)")


def _installed_class(folder: Path):
    """(library, class) of a component folder's config.json; a class the installed library lacks is refused."""
    kind, cls, name = _class_of(folder)
    if cls is None:
        raise FileFormatError(f"{folder}: class {name} is not in the installed {kind}", f"pip install -U {kind}")
    return kind, cls


def _empty_model(kind: str, cls, folder: Path):
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if kind == "diffusers":
            return cls.from_config(cls.load_config(folder))
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(folder))


def expected_shapes(folder) -> dict[str, tuple[int, ...]]:
    """name -> shape of every weight a component folder's class holds (its config.json; nothing is read)."""
    folder = Path(folder)
    kind, cls = _installed_class(folder)
    return {k: tuple(v.shape) for k, v in _empty_model(kind, cls, folder).state_dict().items()}


def _fp32_names(model, dtype=None) -> list[str]:
    """The modules kept in float32 when the model is loaded in `dtype`, by its library's rule: diffusers keeps
    `_keep_in_fp32_modules` in float32 at any dtype; transformers keeps them so only for float16 (its
    `_keep_in_fp32_modules_strict`: for float16 and bfloat16) — umT5 and T5 load their `wo` in bfloat16 at bf16."""
    import torch

    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if type(model).__module__.startswith("transformers"):
        strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        return keep + strict if dtype in (None, torch.float16) else strict if dtype == torch.bfloat16 else []
    return keep


def _kept_fp32(name: str, keep: list[str]) -> bool:
    """Does this parameter or module name fall under the class's `_keep_in_fp32_modules`?"""
    return any(f in name for f in keep)


def keep_fp32(model):
    """Put back in float32 the modules the class keeps there (`_keep_in_fp32_modules`, e.g. Kandinsky 5's time
    embeddings and modulations, which its forward feeds float32 inputs) after a whole-model `.to(bf16)`, as
    loading does; returns the model."""
    import torch

    keep = _fp32_names(model)
    for name, module in model.named_modules():
        if keep and _kept_fp32(name, keep):
            module.to(torch.float32)
    return model


def _cast(sd: dict, dtype, keep: list[str]) -> None:
    """Floating-point tensors to `dtype`, one at a time in place (never a second whole copy); those the class keeps
    in float32 (`_keep_in_fp32_modules`) to float32 whatever the file stores them in, as diffusers loads them."""
    import torch

    for k in list(sd):
        v = sd[k]
        if v.is_floating_point():
            want = torch.float32 if _kept_fp32(k, keep) else dtype
            if v.dtype != want:
                sd[k] = v.to(want)


def _renamed(cls, folder: Path, device: str, dtype):
    """A transformers component whose file names its tensors in an older layout (e.g. Qwen2.5-VL's `model.*` and
    `visual.*`, as the hub's Qwen-Image text encoder stores them): transformers renames them while loading. The
    bytes still come through lorakit.io, mapped on the CPU (the file's pages, no copy), and transformers puts each
    tensor on the device as it fills the model — the component is resident once (a 24 GB card could not hold the
    7 B encoder twice)."""
    import torch
    from transformers import AutoConfig

    sd = load(folder, device="cpu", backend="lorakit")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    out = cls.from_pretrained(None, config=AutoConfig.from_pretrained(folder), state_dict=sd,
                              dtype=dtype if dtype is not None else "auto", device_map={"": dev})
    return out.eval().requires_grad_(False)


def load_component(folder, device: str = "cpu", dtype=None, backend: str = "auto", unified_memory: bool = False):
    """Build one pipeline component from its folder.

    Args:
        folder: component folder (config.json + safetensors, sharded or not).
        device: target device; dtype: floating-point dtype (None: as stored).
        backend: `lorakit.io` backend.

    Returns:
        the module, in eval mode, with requires_grad False.
    """

    folder = Path(folder)
    kind, cls = _installed_class(folder)
    model = _empty_model(kind, cls, folder)
    expected = dict(model.state_dict(keep_vars=True))
    unexpected = [k for f in resolve_files(folder) for k in read_header(f).tensors if k not in expected]
    if unexpected and kind == "transformers":
        return _renamed(cls, folder, device, dtype)
    if unexpected:
        raise FileFormatError(f"{folder}: keys the {cls.__name__} class does not have: {', '.join(unexpected[:5])}",
                              "the weights belong to another model or version")
    sd = load(folder, device=device, backend=backend, unified_memory=unified_memory)
    if dtype is not None:
        _cast(sd, dtype, _fp32_names(model, dtype))
    missing = model.load_state_dict(sd, strict=False, assign=True).missing_keys
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise FileFormatError(f"{folder}: weights missing for {', '.join(still_meta[:5])}"
                              + (f" and {len(still_meta) - 5} more" if len(still_meta) > 5 else ""),
                              "the checkpoint is incomplete or for another model")
    del missing  # tied or non-persistent: filled above
    model = model.to(device)  # buffers and non-persistent tensors; parameters are already there
    return model.eval().requires_grad_(False)



def fill_random(model, device: str, dtype, seed: int = 0, keep_on: str | None = None):
    """A module built on the meta device given random weights made on `device` (kept there or moved to `keep_on`),
    in `dtype` except what its class keeps in float32: weights ~ N(0, 0.02), biases 0, norm scales 1 (activations
    stay finite through every block in bf16). Returns the module, in eval mode, with requires_grad False."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for n, p in model.named_parameters():
        t = torch.empty(p.shape, device=device, dtype=dtype)
        if n.endswith("bias"):
            t.zero_()
        elif "norm" in n and p.dim() == 1:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        sd[n] = t if keep_on is None else t.to(keep_on)
    model.load_state_dict(sd, strict=True, assign=True)
    return keep_fp32(model.to(keep_on or device)).eval().requires_grad_(False)


def random_component(folder, device: str, dtype, blocks: int | None = None, seed: int = 0):
    """The component of a folder's config.json with random weights (nothing read): the class, shapes and dtypes
    `load_component` gives. `blocks`: each list of the class's repeated blocks (diffusers' `_repeated_blocks`)
    cut to its first `blocks` — the same kinds of block, called with the same inputs, at a fraction of the size."""
    import torch

    folder = Path(folder)
    kind, cls = _installed_class(folder)
    model = _empty_model(kind, cls, folder)
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if blocks is not None and names:
        for parent in list(model.modules()):
            for attr, child in list(parent.named_children()):
                if isinstance(child, torch.nn.ModuleList) and any(type(b).__name__ in names for b in child):
                    setattr(parent, attr, torch.nn.ModuleList(list(child)[:blocks]))
    return fill_random(model, device, dtype, seed)


def load_facts(modules, seconds: float) -> dict:
    """What a timed load read, for a phase line: its GiB and GB/s."""
    params = [p for m in modules for p in m.parameters()]
    size = sum(p.numel() * p.element_size() for p in params)
    return {"gib": round(size / 2**30, 2), "gb_per_s": round(size / 1e9 / max(seconds, 1e-9), 2)}
