"""The matrix's stock reference (`lorakit.bench.stock`): where it places the pipeline, and that its split placement
(the text encoder alone, then the rest given the embeddings) draws the same image as the pipeline whole."""

import numpy as np
import pytest
from PIL import Image

from lorakit.bench import stock

GIB = 2**30


@pytest.mark.parametrize("size, gpu, host, offload, want", [
    (30, 80, 120, False, "none"),     # fits the GPU: resident
    (105, 80, 500, False, "model"),   # FLUX.2 [dev] on an H100 whose host holds it: model offload
    (105, 80, 64, False, "split"),    # ... whose host has 64 GiB available (the transformer in /dev/shm): split
    (30, 80, 120, True, "model"),     # matrix lanes share the GPU
    (30, 80, 20, True, "split"),
    (105, None, 8, False, "none"),    # no GPU: on the CPU as it is
    (105, 80, None, False, "model"),  # the host says nothing: as before
])
def test_the_placement_follows_the_gpus_and_the_hosts_room(size, gpu, host, offload, want):
    assert stock.placement(size * GIB, gpu and gpu * GIB, host and host * GIB, offload) == want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux2-dev", "flux"])
def test_the_split_placement_draws_the_same_image_as_the_whole_pipeline(tmp_path, tiny, family):
    from tests.loras import trained_like

    lora = trained_like(tiny, family, tmp_path / "lora.safetensors", targets="attention")
    spec = {"model": str(tiny(family)), "lora": str(lora), "family": family, "prompt": "a red fox in the snow",
            "steps": 2, "seed": 0, "width": 64, "height": 64, "frames": 1, "image": [], "offload": False}
    images = {}
    for place in ("none", "split"):
        res = stock.run({**spec, "place": place, "out": str(tmp_path / f"{place}.png")})
        assert res["offload"] == place
        images[place] = np.asarray(Image.open(tmp_path / f"{place}.png"))
    assert images["none"].std() > 0  # an image, not a blank
    assert np.array_equal(images["none"], images["split"])


def test_an_edit_models_encoder_that_reads_the_image_is_not_split(tmp_path, tiny):
    with pytest.raises(SystemExit, match="takes the image"):
        model = str(tiny("qwen-image-edit"))
        stock._embeddings(model, stock._encoders(model)[1], None, "cpu", "a cat")
