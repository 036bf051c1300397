"""Batches from the cache: deterministic order per (seed, epoch), text padded with a mask, full masks dropped."""

import pytest
import torch

from lorakit.cache.store import Store
from lorakit.models.batch import Batch, drop_full_mask
from lorakit.train.data import CachedData


def _store(tmp_path, lengths=(3, 5, 4, 2), buckets=((64, 64), (64, 64), (48, 80), (48, 80))):
    st = Store(tmp_path / "c")
    items = []
    for i, (n, b) in enumerate(zip(lengths, buckets, strict=True)):
        key = f"k{i}"
        st.put(key, {"latents": torch.full((16, b[1] // 8, b[0] // 8), float(i)),
                     "prompt_embeds": torch.full((n, 8), float(i)), "pooled": torch.full((8,), float(i))}, {})
        items.append({"key": key, "bucket": list(b)})
    st.put("empty", {"prompt_embeds": torch.zeros(1, 8), "pooled": torch.zeros(8)}, {})
    return st, {"items": items, "empty_caption": "empty"}


def test_batches_never_mix_buckets_and_repeat_per_seed(tmp_path):
    st, man = _store(tmp_path)
    a, b = CachedData(st, man, 2, seed=3), CachedData(st, man, 2, seed=3)
    seq = [a.batch_at(i) for i in range(8)]
    assert seq == [b.batch_at(i) for i in range(8)]  # a pure function of (seed, epoch): resume gets the same
    bucket = {it["key"]: tuple(it["bucket"]) for it in man["items"]}
    assert all(len({bucket[k] for k in batch}) == 1 for batch in seq)
    assert seq != [CachedData(st, man, 2, seed=4).batch_at(i) for i in range(8)]


def test_text_is_padded_with_a_mask_and_dropout_uses_the_empty_caption(tmp_path):
    st, man = _store(tmp_path)
    d = CachedData(st, man, 2, seed=0)
    b = d.load(["k0", "k1"], drop=[False, True])
    assert b.text["prompt_embeds"].shape == (2, 3, 8)  # k1 was dropped: its text is the empty caption (1 token)
    assert b.text["prompt_embeds_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert float(b.text["pooled"][1].abs().sum()) == 0 and b.latents.shape == (2, 16, 8, 8)


def test_a_mask_that_masks_nothing_is_dropped(tmp_path):
    st, man = _store(tmp_path)
    b = CachedData(st, man, 1, seed=0).load(["k1"])
    assert "prompt_embeds_mask" not in b.text  # batch 1: flash attention can take it
    kept = drop_full_mask(Batch(["x"], None, {"prompt_embeds": torch.zeros(1, 2, 4),
                                              "prompt_embeds_mask": torch.tensor([[1, 0]])}, []))
    assert "prompt_embeds_mask" in kept.text


def test_held_out_items_are_fixed_by_the_seed_and_repeats_multiply_an_epoch(tmp_path):
    st, man = _store(tmp_path)
    d = CachedData(st, man, 1, seed=5, repeats=3, hold_out=1)
    assert len(d.validation) == 1 and len(d.epoch(0)) == 9
    assert d.validation == CachedData(st, man, 1, seed=5, hold_out=1).validation
    from lorakit.errors import ConfigError

    with pytest.raises(ConfigError, match="no item to train on"):
        CachedData(st, man, 1, seed=5, hold_out=4)


def test_the_data_counts_the_shapes_a_step_meets(tmp_path):
    st, man = _store(tmp_path)
    assert CachedData(st, man, 2, seed=0).shapes == 2
    one = {**man, "items": [it for it in man["items"] if it["bucket"] == [64, 64]]}
    assert CachedData(st, one, 2, seed=0).shapes == 1
