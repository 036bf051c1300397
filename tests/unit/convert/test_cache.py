import json

import torch
from typer.testing import CliRunner

from lorakit.cache.store import Store
from lorakit.cli.app import app


def _run(*args):
    return CliRunner().invoke(app, ["convert", "cache", *map(str, args)])


def test_legacy_items_become_a_store(tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    g = torch.Generator().manual_seed(0)
    items = {}
    for i in range(3):
        d = {"latents": torch.randn(1, 16, 8, 12, generator=g), "prompt_embeds": torch.randn(1, 7, 32, generator=g),
             "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
        torch.save(d, legacy / f"img{i}.pt")
        items[f"img{i}"] = d
    r = _run(legacy, "--out", tmp_path / "store", "--family", "flux", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["items"] == 3
    store = Store(tmp_path / "store")
    man = store.read_manifest()
    assert man["family"] == "flux" and len(man["items"]) == 3
    for it in man["items"]:
        got, want = store.get(it["key"]), items[it["stem"]]
        assert torch.equal(got["latents"], want["latents"][0]) and torch.equal(got["pooled"], want["pooled_prompt_embeds"][0])
        assert torch.equal(got["prompt_embeds"], want["prompt_embeds"][0]) and it["bucket"] == [96, 64]
    from lorakit.train.data import CachedData

    b = CachedData(store, man, batch_size=1, seed=0).load([man["items"][0]["key"]])
    assert b.latents.shape == (1, 16, 8, 12)


class Evil:
    def __reduce__(self):
        return (print, ("this ran",))


def test_pickles_and_odd_files_are_refused_and_nothing_is_written(tmp_path):
    cases = {
        "evil": ({"latents": torch.zeros(16, 2, 2), "x": Evil()}, "refused"),
        "notdict": ([torch.zeros(2)], "not a dict"),
        "noint": ({"latents": torch.zeros(16, 2, 2), "prompt_embeds": torch.zeros(3, 4), "step": 5}, "not a tensor"),
        "nolatents": ({"prompt_embeds": torch.zeros(3, 4)}, "no latents"),
    }
    for name, (obj, words) in cases.items():
        d = tmp_path / name
        d.mkdir()
        torch.save({"latents": torch.zeros(16, 2, 2), "prompt_embeds": torch.zeros(3, 4)}, d / "a_good.pt")
        torch.save(obj, d / "b_bad.pt")
        r = _run(d)
        assert r.exit_code == 2 and words in r.output, (name, r.output)
        assert "this ran" not in r.output
        assert not (d / "lorakit-cache").exists()
