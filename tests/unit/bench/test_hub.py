"""The synthetic hub-layout model folders (`lorakit.bench.hub`): the published architectures, the hub's file
layout, and folders that the stock pipeline and lorakit both load."""

import json

import pytest
import torch

from lorakit.bench import hub
from lorakit.models import published
from lorakit.models.base import family_adapter

# Parameters of each published component (FLUX.1-dev, Qwen-Image / -Edit-2509 and Kandinsky 5.0 T2I Lite:
# transformer, CLIP-L, T5-XXL encoder, Qwen2.5-VL-7B, the FLUX and Qwen-Image VAEs), as their hub files hold them.
PUBLISHED = {
    "flux": {"transformer": 11_901_408_320, "text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656,
             "vae": 83_819_683},
    "qwen-image": {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531},
    "qwen-image-edit-plus": {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531},
    "kandinsky5-t2i": {"transformer": 6_022_080_576, "text_encoder": 8_292_166_656, "text_encoder_2": 123_060_480,
                       "vae": 83_819_683},
    # Z-Image-Turbo: the transformer config FACTS.md read from diffusers (dim 3840, 30 + 2 + 2 layers), Qwen3-4B's
    # config (tied embeddings), FLUX's VAE; not checked against the hub's files (no hub here)
    "z-image": {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096, "vae": 83_819_683},
    # Qwen-Image-2.1: the class defaults (its published transformer and VAE configs, as diffusers states them) and
    # Qwen3-VL-8B's config (8.77B parameters with its vision tower, as its model card says); no hub files here
    "qwen-image-2.1": {"transformer": 7_115_124_736, "text_encoder": 8_767_123_696, "vae": 337_740_404},
}


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_full_size_components_have_the_published_parameter_counts(family):
    import diffusers

    adapter = family_adapter(family)
    pipe = adapter.build_tiny(0)
    counts = {}
    with torch.device("meta"):  # the architecture only: no memory, no time
        for name, part in pipe.components.items():
            if not isinstance(part, torch.nn.Module):
                continue
            module = (getattr(diffusers, adapter.info.transformer_class)(**adapter.full_config)
                      if name == "transformer" else published.full_component(name, part, hub._tokenizer_for(name, pipe)))
            counts[name] = sum(t.numel() for t in module.parameters())  # tied weights once, as the files hold them
    assert counts == PUBLISHED[family]


@pytest.mark.parametrize("family", ["flux", "qwen-image-edit-plus", "kandinsky5-t2i"])
def test_written_folder_is_sharded_as_the_hub_and_loads_in_diffusers_and_lorakit(tmp_path, monkeypatch, family):
    from diffusers import DiffusionPipeline

    from lorakit.io import load
    from lorakit.models.base import load_adapter

    monkeypatch.setattr(hub, "SHARD_BYTES", {"diffusers": 40_000, "transformers": 20_000})  # several shards each
    out = tmp_path / family
    report = hub.write_model(family, out, device="cpu", scale="tiny")
    index = json.loads((out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    assert json.loads((out / "lorakit_synthetic.json").read_text())["components"] == report["components"]

    pipe = DiffusionPipeline.from_pretrained(out)  # the stock loader reads the sharded folder
    assert type(pipe).__name__ == family_adapter(family).info.pipeline_class
    for name, rec in report["components"].items():
        module = getattr(pipe, name)
        assert type(module).__name__ == rec["class"]
        stored = load(out / name)  # every stored tensor is the module's (nothing missing, nothing extra)
        state = published.hub_names(rec["class"], hub._unique_tensors(module))  # under the published files' names
        assert sorted(stored) == sorted(state) and sum(t.numel() for t in stored.values()) == rec["params"]
        assert all(torch.equal(stored[k], state[k]) for k in stored)
    if "text_encoder" in report["components"] and report["components"]["text_encoder"]["class"].startswith("Qwen2_5"):
        names = list(load(out / "text_encoder"))  # as the hub's Qwen2.5-VL shards name them (loaders rename)
        assert any(k.startswith("model.layers.") for k in names) and any(k.startswith("visual.") for k in names)
        assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in names)
    adapter = load_adapter(family, out)  # and lorakit's own loading of the same folder
    adapter.load(list(report["components"]))
    for name, rec in report["components"].items():
        assert type(adapter.parts[name]).__name__ == rec["class"]
        ours, stock = hub._unique_tensors(adapter.parts[name]), hub._unique_tensors(getattr(pipe, name))
        assert sorted(ours) == sorted(stock) and all(torch.equal(ours[k], stock[k]) for k in ours)


def test_a_family_of_the_same_weights_links_them_instead_of_writing(tmp_path):
    """Qwen-Image-Edit beside Qwen-Image (the same transformer, text encoder and VAE): the matrix writes the second
    folder by hard-linking each component the first holds (a 54 GB write each otherwise); a family of other weights
    links nothing and `reusable` says what it would write."""
    import os

    from lorakit.io import load

    first = tmp_path / "qwen-image"
    hub.write_model("qwen-image", first, device="cpu", scale="tiny")
    same, need = hub.reusable("qwen-image-edit", first, scale="tiny")
    assert sorted(same) == ["text_encoder", "transformer", "vae"] and need == 0
    report = hub.write_model("qwen-image-edit", tmp_path / "qwen-image-edit", device="cpu", scale="tiny", like=first)
    for name in same:
        assert report["components"][name]["linked_from"] == str(first)
        for f in (first / name).glob("*.safetensors"):
            assert os.stat(f).st_ino == os.stat(tmp_path / "qwen-image-edit" / name / f.name).st_ino
    assert (tmp_path / "qwen-image-edit" / "processor").is_dir()  # the family's own files are its own
    from lorakit.models.base import load_adapter

    adapter = load_adapter("qwen-image-edit", tmp_path / "qwen-image-edit")
    adapter.load(["transformer"])
    stored = load(first / "transformer")
    ours = hub._unique_tensors(adapter.parts["transformer"])
    assert sorted(stored) == sorted(ours) and all(torch.equal(stored[k], ours[k]) for k in stored)

    same, need = hub.reusable("flux", first, scale="tiny")
    assert same == [] and need > 0
    other = hub.write_model("flux", tmp_path / "flux", device="cpu", scale="tiny", like=first)
    assert not any("linked_from" in c for c in other["components"].values())


def test_a_component_kept_on_another_disk_is_linked_loaded_and_removed_with_the_folder(tmp_path):
    """`homes`: FLUX.2 [dev]'s 105 GiB beside a 64 GiB disk, its transformer in RAM-backed /dev/shm: the model folder
    links the component's folder, lorakit and diffusers read through the link, writing again replaces the old files
    and `remove_model` removes both."""
    from lorakit.errors import InputError
    from lorakit.io import load
    from lorakit.models.base import load_adapter

    out, home = tmp_path / "disk" / "flux", tmp_path / "shm" / "flux" / "transformer"
    hub.write_model("flux", out, device="cpu", scale="tiny", homes={"transformer": home})
    assert (out / "transformer").is_symlink() and (out / "transformer").resolve() == home.resolve()
    assert sorted(p.name for p in home.iterdir()) == sorted(
        ["config.json", "diffusion_pytorch_model.safetensors"]), list(home.iterdir())
    assert not (out / "vae").is_symlink()
    linked = (home / "diffusion_pytorch_model.safetensors").resolve()
    assert linked in [f.resolve() for f in hub.weight_files(out)]  # what --cold evicts and stock sizes
    adapter = load_adapter("flux", out)
    adapter.load(["transformer"])
    stored = load(home)
    ours = hub._unique_tensors(adapter.parts["transformer"])
    assert sorted(stored) == sorted(ours) and all(torch.equal(stored[k], ours[k]) for k in stored)
    stale = home / "stale.safetensors"
    stale.write_bytes(b"x")
    hub.write_model("flux", out, device="cpu", scale="tiny", seed=1, homes={"transformer": home})
    assert not stale.exists() and (out / "transformer").is_symlink()
    hub.remove_model(out)
    assert not out.exists() and not home.exists() and (tmp_path / "shm").is_dir()
    with pytest.raises(InputError, match="text_encoder_3: flux has no such component"):
        hub.write_model("flux", out, device="cpu", scale="tiny", homes={"text_encoder_3": home})


def test_a_write_cut_short_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A full disk mid-write (FLUX.2 [dev] Edit's 45 GiB encoder beside 17 GiB free: 13 GiB of shards were left):
    the folder and its component kept elsewhere are removed, and the disk's own error is the one raised."""
    out, home = tmp_path / "disk" / "flux", tmp_path / "shm" / "flux" / "transformer"
    real, calls = hub.save_sharded, []

    def fills_the_disk(tensors, folder, **kw):
        calls.append(folder.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, folder, **kw)

    monkeypatch.setattr(hub, "save_sharded", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        hub.write_model("flux", out, device="cpu", scale="tiny", homes={"transformer": home})
    assert len(calls) == 2 and not out.exists() and not home.exists()
