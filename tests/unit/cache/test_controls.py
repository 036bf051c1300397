"""Edit families: what the cache holds for an item with 1, 2 or 3 control images makes exactly the transformer
call the stock pipeline makes for the same images and instruction (prompt embeddings that saw the images,
control latents at the pipeline's sizes, rotary shapes / position ids), CPU fp32, 1e-5.

The stock pipeline runs with lorakit's noise as its latents; the first call into its transformer is captured
and compared, argument by argument, with the call `adapter.predict` makes from the cached entry."""

import numpy as np
import pytest
import torch
from PIL import Image

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.config import validate
from lorakit.models.base import load_adapter

SIZES = [(96, 64), (64, 80), (64, 64)]  # control, control_2, control_3: other aspect ratios than the target's


class Captured(Exception):
    pass


def first_call(transformer, fn):
    """The keyword arguments of the first forward call of `transformer` while fn() runs."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)
        raise Captured

    h = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        fn()
    except Captured:
        pass
    finally:
        h.remove()
    return seen


def noise_image(w, h, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def edit_dataset(root, n_controls: int, seed: int):
    (root / "images").mkdir(parents=True)
    noise_image(64, 64, seed).save(root / "images" / "a.png")
    (root / "images" / "a.txt").write_text(f"put the things of the {n_controls} pictures together\n")
    for k in range(n_controls):
        d = root / ("control" if k == 0 else f"control_{k + 1}")
        d.mkdir()
        noise_image(*SIZES[k], seed * 10 + k).save(d / "a.png")
    return root


def assert_same_call(stock: dict, ours: dict):
    assert {"hidden_states", "encoder_hidden_states"} <= set(stock) & set(ours)
    for k, v in stock.items():
        w = ours.get(k)
        if k in ("encoder_hidden_states_mask",) and (v is None or w is None):  # None means: all ones
            m = v if v is not None else w
            assert m is None or bool(m.all()), k
        elif isinstance(v, torch.Tensor):
            assert isinstance(w, torch.Tensor), f"{k}: lorakit passes {type(w).__name__}"
            torch.testing.assert_close(w.float(), v.float(), rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        elif k in ("img_shapes", "txt_seq_lens"):
            assert w == v, f"{k}: {w} != {v}"


def cached(tmp_path, family, model, dirs):
    cfg = validate({"profile": "cpu", "model": {"family": family, "path": str(model), "dtype": "fp32"},
                    "data": {"dirs": [str(d) for d in dirs], "resolution": 64, "bucket_min_side": 32,
                             "bucket_max_side": 128},
                    "output": {"dir": str(tmp_path / "out")}})
    assert build(cfg).skipped == []
    st = Store(cache_dir_for(cfg))
    return {it["source"].split("/")[-3]: (it, st.get(it["key"])) for it in st.read_manifest()["items"]}


@pytest.mark.slow
def test_edit_plus_with_one_and_three_controls_equals_the_stock_pipeline(tmp_path, tiny):
    from diffusers import QwenImageEditPlusPipeline

    family = "qwen-image-edit-plus"
    model = tiny(family)
    dirs = [edit_dataset(tmp_path / f"n{n}", n, seed=n) for n in (1, 3)]  # one, and the most (2: the same path)
    entries = cached(tmp_path, family, model, dirs)
    a = load_adapter(family, model)
    pipe = QwenImageEditPlusPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for n in (1, 3):
        it, e = entries[f"n{n}"]
        controls = [Image.open(c).convert("RGB") for c in it["controls"]]
        assert len(controls) == n
        noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(n))
        packed = pipe._pack_latents(noise, 1, 16, 8, 8)
        stock = first_call(pipe.transformer, lambda c=controls, p=packed, i=it: pipe(
            image=c, prompt=i["caption"], latents=p, height=64, width=64, num_inference_steps=2,
            output_type="latent"))
        text = {"prompt_embeds": e["prompt_embeds"][None]}
        ctrl = [e[f"control_latents_{k}"][None] for k in range(n)]
        ours = first_call(pipe.transformer, lambda t=text, c=ctrl, x=noise: a.predict(pipe.transformer, x,
                                                                                      torch.tensor([1.0]), t,
                                                                                      controls=c))
        assert_same_call(stock, ours)
        assert stock["hidden_states"].shape[1] > 16 * n  # the controls are in the call, at ~1024² each


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen-image-edit", "flux-kontext"])
def test_single_control_edit_families_equal_the_stock_pipeline(tmp_path, tiny, family):
    from diffusers import DiffusionPipeline

    model = tiny(family)
    entries = cached(tmp_path, family, model, [edit_dataset(tmp_path / "n1", 1, seed=5)])
    a = load_adapter(family, model)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    it, e = entries["n1"]
    control = Image.open(it["controls"][0]).convert("RGB")
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    packed = pipe._pack_latents(noise, 1, 16, 8, 8)
    kw = dict(image=control, prompt=it["caption"], latents=packed, height=64, width=64, num_inference_steps=2,
              output_type="latent")
    text = {k: v[None] for k, v in e.items() if k in ("prompt_embeds", "pooled")}
    guidance = {}
    if family == "flux-kontext":
        kw["guidance_scale"] = guidance["guidance"] = 2.5
        kw["max_area"] = 64 * 64  # else the pipeline rescales the requested 64² target to 1024²
    stock = first_call(pipe.transformer, lambda: pipe(**kw))
    ours = first_call(pipe.transformer, lambda: a.predict(pipe.transformer, noise, torch.tensor([1.0]), text,
                                                          controls=[e["control_latents_0"][None]], **guidance))
    assert_same_call(stock, ours)
