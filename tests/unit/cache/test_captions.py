"""Caption shuffling: each item cached with orderings of its tags (the first keep_tokens in place), each the
text encoder's output for that ordering; training draws one per step."""

import torch

from lorakit.cache.builder import build, cache_dir_for, caption_variants
from lorakit.cache.store import Store
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import resolve
from lorakit.train.loop import run
from tests.unit.train.test_loop import make_cfg


def test_variants_keep_the_first_tags_and_shuffle_the_rest():
    caps = caption_variants("sks dog, red collar, grass, sunny, park", 6, 1, "key")
    assert caps[0] == "sks dog, red collar, grass, sunny, park"
    assert all(c.startswith("sks dog, ") for c in caps)
    assert all(sorted(c.split(", ")) == sorted(caps[0].split(", ")) for c in caps)
    assert len(set(caps)) > 2
    assert caps == caption_variants("sks dog, red collar, grass, sunny, park", 6, 1, "key")  # seeded by the key


def test_cached_variants_are_the_encoders_outputs_and_training_uses_them(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=4, data={"caption_shuffle": True, "caption_variants": 3,
                                                                  "trigger": "sks"},
                   sampling={"enabled": False})
    for t in cfg.data.dirs[0].glob("*.txt"):
        t.write_text("red, circle, blue background, centered")
    a = load_adapter("flux", tiny("flux"))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    it = st.read_manifest()["items"][0]
    e = st.get(it["key"])
    caps = caption_variants(it["caption"], 3, 1, it["key"])
    assert it["caption"] == "sks red, circle, blue background, centered"
    for v in (1, 2):
        enc = a.encode_prompts([caps[v]])[0]
        torch.testing.assert_close(e[f"prompt_embeds@{v}"], enc["prompt_embeds"])
        torch.testing.assert_close(e[f"pooled@{v}"], enc["pooled"])
    res = run(resolve(cfg))
    assert res["steps"] == 4 and res["cache"]["reused"] == 4
