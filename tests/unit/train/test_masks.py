"""Masked loss: masks/ beside the images, cached at latent resolution with the item; masked-out latents add
nothing to the loss and get no gradient; a changed mask file re-encodes its item."""

import os

import pytest
import torch
from PIL import Image

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.data.dataset import scan
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train.data import CachedData
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import make_cfg


def _masked(cfg):
    """A mask per item (PNG whatever the image's format): left half white (trained), right half black."""
    root = cfg.data.dirs[0]
    (root / "masks").mkdir()
    for img in sorted(p for p in root.iterdir() if p.suffix != ".txt" and p.is_file()):
        w, h = Image.open(img).size
        m = Image.new("L", (w, h), 0)
        m.paste(255, (0, 0, w // 2, h))
        m.save(root / "masks" / f"{img.stem}.png")
    return root


def test_masked_out_latents_add_nothing_and_get_no_gradient(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2)
    root = _masked(cfg)
    a = load_adapter("flux", tiny("flux"))
    first = build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    b = data.load([data.items[0]["key"]])
    w = b.latents.shape[-1]
    assert b.mask.shape == (1, 1, *b.latents.shape[-2:])
    assert torch.all(b.mask[..., : w // 2] == 1) and torch.all(b.mask[..., w // 2:] == 0)

    tr = Trainer(cfg, a, load_component(tiny("flux") / "transformer"), data, tmp_path / "o", "cpu", torch.float32)
    seen = {}
    predict = tr.adapter.predict

    def keep(*args, **kw):  # the prediction, kept to read its gradient
        v = predict(*args, **kw)
        v.retain_grad()
        seen["v"] = v
        return v

    tr.adapter.predict = keep
    sig, noise = torch.tensor([0.5]), torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(1))
    loss = tr.loss_on(b, sig, noise)
    loss.backward()
    loss = float(loss.detach())
    g = seen["v"].grad
    assert torch.all(g[..., w // 2:] == 0) and g[..., : w // 2].abs().sum() > 0
    # the loss is the mean over the kept half alone
    v, target = seen["v"].detach(), noise - b.latents
    assert loss == pytest.approx(float(((v - target)[..., : w // 2] ** 2).mean()), rel=1e-5)

    # a changed mask file: only its item is encoded again
    one = sorted((root / "masks").glob("*.png"))[0]
    Image.new("L", Image.open(one).size, 255).save(one)
    os.utime(one, ns=(1, 1))
    again = build(cfg, adapter=a)
    assert first.encoded == 4 and again.encoded == 1


def test_every_item_needs_its_mask_and_the_same_size(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2)
    root = _masked(cfg)
    masks = sorted((root / "masks").glob("*.png"))
    masks[0].unlink()
    Image.new("L", (32, 64)).save(masks[1])
    Image.new("L", (64, 64)).save(root / "masks" / "stray.png")
    codes = {(p.code, os.path.basename(p.path)) for p in scan(root, min_side=32).problems}
    assert ("no-mask", masks[0].name) in codes
    assert ("mask-size", masks[1].name) in codes
    assert ("no-target", "stray.png") in codes


def test_the_alpha_channel_is_the_mask_when_asked(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, data={"alpha_mask": True})
    root = cfg.data.dirs[0]
    for img in sorted(p for p in root.iterdir() if p.suffix != ".txt")[:3]:  # three PNGs with alpha, one without
        im = Image.open(img).convert("RGBA")
        a = Image.new("L", im.size, 0)
        a.paste(255, (0, 0, im.width // 2, im.height))
        im.putalpha(a)
        img.unlink()
        im.save(img.with_suffix(".png"))
    problems = scan(root, min_side=32, alpha_mask=True).problems
    assert [(p.code, os.path.basename(p.path)) for p in problems] == [("no-alpha", "item_003.webp")]
    build(cfg, adapter=load_adapter("flux", tiny("flux")))
    st = Store(cache_dir_for(cfg))
    man = st.read_manifest()
    assert len(man["items"]) == 3
    m = st.get(man["items"][0]["key"])["loss_mask"]
    w = m.shape[-1]
    assert torch.all(m[..., : w // 2] == 1) and torch.all(m[..., w // 2:] == 0)
