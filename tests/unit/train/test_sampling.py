"""Training-time samples: the sampler renders what the stock pipeline renders, and `train` writes the grids."""

import pytest
import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import resolve
from lorakit.train.data import CachedData
from lorakit.train.loop import run
from lorakit.train.sampling import conditions, render
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import make_cfg


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_sampler_matches_the_stock_pipeline(tmp_path, tiny, family):
    from diffusers import DiffusionPipeline

    cfg = make_cfg(tmp_path, family, tiny(family), steps=2, sampling={"steps": 6, "guidance": 3.5 if family ==
                                                                           "flux" else 1.0, "seed": 5})
    a = load_adapter(family, tiny(family))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    conds = conditions(cfg, a, data, limit=1)
    tr = Trainer(cfg, a, load_component(tiny(family) / "transformer"), data, tmp_path / "o", "cpu", torch.float32)
    ours = render(tr, conds)[0]
    c = conds[0]
    pipe = DiffusionPipeline.from_pretrained(tiny(family))
    pipe.transformer = tr.transformer  # the model being trained (LoRA attached, still zero)
    _, ch, h, w = (1, *c.shape)
    noise = torch.randn((1, *c.shape), generator=torch.Generator().manual_seed(5))
    latents = type(pipe)._pack_latents(noise, 1, ch, h, w)
    kw = dict(latents=latents, num_inference_steps=6, height=h * 8, width=w * 8, output_type="np",
              prompt_embeds=c.text["prompt_embeds"])
    if family == "flux":
        kw.update(pooled_prompt_embeds=c.text["pooled"], guidance_scale=3.5)
    else:
        kw.update(prompt_embeds_mask=torch.ones(c.text["prompt_embeds"].shape[:2], dtype=torch.long),
                  true_cfg_scale=1.0)
    stock = pipe(**kw).images[0]
    import numpy as np

    diff = np.abs(np.asarray(ours).astype(float) - stock * 255).max()
    mean = np.abs(np.asarray(ours).astype(float) - stock * 255).mean()
    assert diff <= 3 and mean < 0.5, (diff, mean)  # 8-bit rounding of the same pixels


@pytest.mark.slow
def test_train_writes_a_grid_before_every_n_steps_and_at_the_end(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "qwen-image-edit", tiny("qwen-image-edit"), steps=5,
                   sampling={"every": 2, "steps": 3, "prompts": ["make it red", "make it blue", "flip it"]})
    res = run(resolve(cfg))
    folder = tmp_path / "out" / "samples"
    assert sorted(p.name for p in folder.iterdir()) == ["progress.png", "step-000000.png", "step-000002.png",
                                                        "step-000004.png", "step-000005.png"]
    from PIL import Image

    rows = [Image.open(folder / f"step-00000{k}.png") for k in (0, 2, 4, 5)]
    grid = Image.open(res["samples"])
    assert grid.height == sum(r.height for r in rows) and grid.width == rows[0].width
    assert Image.open(folder / "step-000000.png").tobytes() != Image.open(folder / "step-000005.png").tobytes()
    # a resumed run keeps the rows rendered before the interruption
    cfg2 = make_cfg(tmp_path / "b", "flux", tiny("flux"), steps=4, sampling={"every": 2, "steps": 2})
    run(resolve(cfg2), stop_at=2)
    res2 = run(resolve(cfg2), resume="latest")
    g2 = Image.open(res2["samples"])
    one = Image.open(tmp_path / "b" / "out" / "samples" / "step-000000.png")
    assert g2.height == 3 * one.height  # steps 0, 2, 4


def test_samples_can_be_turned_off(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, sampling={"enabled": False})
    res = run(resolve(cfg))
    assert "samples" not in res and not (tmp_path / "out" / "samples").exists()
    t = res["timeline"]  # how long a user waited, and on what
    assert t["cached"] <= t["model_ready"] <= t["first_step"] and "first_samples" not in t
    assert res["peak_rss_gib"] > 0.1 and res["peak_gpu_gib"] is None
    import json

    doctor = json.loads((tmp_path / "out" / "doctor.json").read_text())  # the doctor summary beside the LoRA
    assert doctor["profile"]["name"] == "cpu" and doctor["facts"] and doctor["summary"]["fail"] == 0


@pytest.mark.slow
def test_edit_samples_show_their_control_images_and_take_explicit_ones(tmp_path, tiny):
    import numpy as np
    from PIL import Image

    from lorakit.train.sampling import Sampler

    family = "qwen-image-edit-plus"
    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (64, 64), (255, 0, 0)).save(red)
    Image.new("RGB", (80, 64), (0, 0, 255)).save(blue)
    cfg = make_cfg(tmp_path, family, tiny(family), steps=2,
                   sampling={"steps": 2, "prompts": ["paint it", "paint it again"], "controls": [[red, blue]]},
                   validation={"items": 1})
    a = load_adapter(family, tiny(family))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0, hold_out=1)
    conds = conditions(cfg, a, data)
    # prompt 0: the given images, encoded as the cache encodes controls; prompt 1: the held-out item's controls
    assert [np.asarray(im)[0, 0].tolist() for im in conds[0].control_images] == [[255, 0, 0], [0, 0, 255]]
    want = a.encode_controls([Image.open(red).convert("RGB"), Image.open(blue).convert("RGB")], 64)
    for got, w in zip(conds[0].controls, want, strict=True):
        torch.testing.assert_close(got[0], w)
    held = data.validation[0]
    assert [Image.open(c).tobytes() for c in held["controls"]] == [im.tobytes() for im in conds[1].control_images]
    tr = Trainer(cfg, a, load_component(tiny(family) / "transformer"), data, tmp_path / "o", "cpu", torch.float32)
    row = Image.open(Sampler(tr, conds, tmp_path / "s")(0)).convert("RGB")
    px = np.asarray(row)
    # the first condition's column starts with its two controls, stacked, each half the cell high: red over blue
    assert (px[10, 100] == [255, 0, 0]).all() and (px[80, 100] == [0, 0, 255]).all()


def test_sampling_controls_are_checked_with_the_config(tmp_path):
    from lorakit.config import check_paths, validate
    from lorakit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate({"model": {"family": "flux"}, "sampling": {"prompts": ["a"], "controls": ["x.png"]}})
    assert "flux takes no control images" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate({"model": {"family": "qwen-image-edit-plus"},
                  "sampling": {"prompts": ["a"], "controls": [["1.png", "2.png", "3.png", "4.png"], "5.png"]}})
    assert "2 given for 1 sampling.prompts" in str(e.value) and "sampling.controls[0]: 4 images" in str(e.value)
    cfg = validate({"model": {"family": "qwen-image-edit"}, "data": {"dirs": [str(tmp_path)]},
                    "sampling": {"prompts": ["a"], "controls": [str(tmp_path / "gone.png")]},
                    "output": {"dir": str(tmp_path / "o")}})
    with pytest.raises(ConfigError, match="sampling.controls\\[0\\]: no such image file"):
        check_paths(cfg, model=False)


def one_sample(tmp_path, tiny, family: str, steps: int):
    """The family's tiny model cached and ready to sample one condition: (adapter, conditions, trainer)."""
    cfg = make_cfg(tmp_path, family, tiny(family), steps=2, sampling={"steps": steps, "seed": 5})
    a = load_adapter(family, tiny(family))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    tr = Trainer(cfg, a, load_component(tiny(family) / "transformer"), data, tmp_path / "o", "cpu", torch.float32)
    return a, conditions(cfg, a, data, limit=1), tr


def test_a_non_finite_sample_is_reported_with_where_it_broke(tmp_path, tiny):
    """A black square says nothing: the sampler names the stage that produced NaN (at real size on an H100 the
    FLUX grids came out black while the loss and `infer` were finite)."""
    a, conds, tr = one_sample(tmp_path, tiny, "flux", steps=3)
    problems = []
    render(tr, conds, problems)
    assert problems == []
    vae = a.parts[a.vae_part]
    w = next(p for n, p in vae.named_parameters() if n.startswith("decoder") and p.dim() == 4)
    with torch.no_grad():
        w[0, 0, 0, 0] = float("nan")
    render(tr, conds, problems)
    assert len(problems) == 1 and "the VAE decode" in problems[0] and "sample 1" in problems[0]
    problems.clear()
    with torch.no_grad():
        tr.transformer.proj_out.bias[0] = float("inf")
    render(tr, conds, problems)
    assert len(problems) == 1 and "prediction at sampling step 1 of 3" in problems[0], problems


@pytest.mark.slow
def test_the_step_0_grid_is_taken_from_an_earlier_run_with_the_same_inputs_and_rendered_when_one_differs(
        tmp_path, tiny, monkeypatch):
    """The untrained LoRA's grid is the base model's: a second run with the same model files, prompts, sampler
    settings and storage (another global seed: other LoRA `A` tensors, a zero `B` all the same) takes the first
    run's step-0 grid from lorakit's cache, byte for byte, says so, and renders only its final grid; another
    sampling seed renders it again."""
    from lorakit.events import Events
    from lorakit.train import sampling

    renders, said = [], []
    real = sampling.render

    def counted(trainer, conds, problems=None):
        renders.append(len(conds))
        return real(trainer, conds, problems)

    class Heard(Events):
        def phase_end(self, name, seconds, facts):
            if name == "samples (step 0)":
                said.append(dict(facts))

    monkeypatch.setattr(sampling, "render", counted)

    def once(sub, seed, sample_seed):
        cfg = make_cfg(tmp_path / sub, "flux", tiny("flux"), steps=1, seed=seed, output={"save_every": 0},
                       schedule={"warmup_steps": 0},
                       sampling={"steps": 2, "seed": sample_seed})
        renders.clear()
        run(resolve(cfg), events=Heard())
        return list(renders), tmp_path / sub / "out" / "samples"

    first, a = once("a", 7, 42)
    assert len(first) == 2 and "reused" not in said[-1]  # step 0 (rendered after step 1), the final grid
    second, b = once("b", 8, 42)
    assert len(second) == 1  # only the final grid
    assert (b / "step-000000.png").read_bytes() == (a / "step-000000.png").read_bytes()
    assert "earlier run" in said[-1]["reused"] and said[-1]["grid"] == str(b / "step-000000.png")
    from PIL import Image

    assert Image.open(b / "progress.png").height == 2 * Image.open(b / "step-000000.png").height
    third, _ = once("c", 7, 43)
    assert len(third) == 2 and "reused" not in said[-1]  # another sampling seed: another picture


def test_the_step_0_grids_key_covers_every_transformer_the_grid_is_sampled_with(tmp_path, tiny):
    """Wan 2.2 A14B samples with both experts whichever one trains: another low-noise expert is another grid."""
    import shutil

    from lorakit.train.first_grid import _transformers

    assert _transformers(load_adapter("flux", tiny("flux"))) == ("transformer",)
    model = tmp_path / "wan"
    shutil.copytree(tiny("wan2.2-t2v"), model)
    a = load_adapter("wan2.2-t2v", model)
    parts = (*_transformers(a), a.vae_part)
    assert parts[:2] == ("transformer", "transformer_2")
    before = a.identity(parts)
    config = model / "transformer_2" / "config.json"
    config.write_text(config.read_text().replace("{", '{"_note": "another expert", ', 1))
    assert a.identity(parts) != before


def test_a_whole_decode_that_runs_out_of_memory_decodes_in_tiles_from_then_on_and_says_so(tmp_path, tiny):
    """On a 24 GiB card Qwen-Image's whole decode at 1232x848 did not fit beside training: the step-0 grid ended
    the run. The sampler decodes that sample and every later one in tiles, says so once, and a tiled decode that
    still runs out is the user's error as before."""
    from lorakit.train.sampling import decode

    a, conds, tr = one_sample(tmp_path, tiny, "qwen-image", steps=2)
    whole = render(tr, conds)[0]
    vae = a.parts[a.vae_part]
    real, calls = vae.decode, []

    def short_of_memory(z, *args, **kw):  # the card's edge: only a tiled decode fits
        calls.append(vae.use_tiling)
        if not vae.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB")
        return real(z, *args, **kw)

    vae.decode = short_of_memory
    problems = []
    tiled = render(tr, conds, problems)[0]
    assert calls == [False, True] and vae.use_tiling
    assert len(problems) == 1 and "decodes in tiles from now on" in problems[0], problems
    assert tiled.size == whole.size
    problems.clear()
    render(tr, conds, problems)
    assert calls == [False, True, True] and problems == []  # said once; later grids decode in tiles straight away
    vae.decode = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        decode(tr, torch.zeros(1, *conds[0].shape))
