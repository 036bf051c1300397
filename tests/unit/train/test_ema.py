"""EMA of the trained LoRA: the formula, step by step; resume restores it bit for bit; files carry it."""

import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.io import load
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train.data import CachedData
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import make_cfg


def _trainer(cfg, tiny, out):
    a = load_adapter("flux", tiny("flux"))
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, cfg.seed)
    return Trainer(cfg, a, load_component(tiny("flux") / "transformer"), data, out, "cpu", torch.float32)


def test_ema_follows_the_formula_and_resumes_exactly(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=8, ema={"enabled": True, "decay": 0.8, "start_step": 2})
    build(cfg, adapter=load_adapter("flux", tiny("flux")))
    tr = _trainer(cfg, tiny, tmp_path / "a")
    expect = [p.detach().clone() for p in tr.params]
    for step in range(1, 6):
        tr.train_step()
        now = [p.detach() for p in tr.params]
        expect = [n.clone() if step <= 2 else 0.8 * e + 0.2 * n for e, n in zip(expect, now, strict=True)]
        for e, s in zip(expect, tr.ema.shadow, strict=True):
            torch.testing.assert_close(s, e, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(s, p) for s, p in zip(tr.ema.shadow, tr.params, strict=True))  # the average lags
    ck = tr.save()
    # the checkpoint's LoRA file holds the average: lora_A as trained (alpha is folded into B only)
    names = [n for n, p in tr.transformer.named_parameters() if p.requires_grad]
    sd = load(ck / "lora.safetensors")
    a_names = [(k, n) for n in names if "lora_A" in n
               for k in [f"transformer.{n.replace('.default', '')}"] if k in sd]
    assert a_names
    for k, n in a_names:
        torch.testing.assert_close(sd[k].float(), tr.ema.shadow[names.index(n)])
    at_save = [s.clone() for s in tr.ema.shadow]
    for _ in range(2):  # the uninterrupted run goes on (LoRA dropout draws from the global RNG, saved with it)
        tr.train_step()
    # resumed: the same average, and the next steps give the same average as the uninterrupted run
    tr2 = _trainer(cfg, tiny, tmp_path / "b")
    tr2.resume(ck)
    assert all(torch.equal(a, b) for a, b in zip(at_save, tr2.ema.shadow, strict=True))
    for _ in range(2):
        tr2.train_step()
    assert all(torch.equal(a, b) for a, b in zip(tr.ema.shadow, tr2.ema.shadow, strict=True))


def test_ema_is_refused_for_full_fine_tuning(tmp_path, tiny):
    import pytest

    from lorakit.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="ema.enabled with method=full"):
        make_cfg(tmp_path, "flux", tiny("flux"), method="full", ema={"enabled": True})
