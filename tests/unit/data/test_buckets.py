from PIL import Image

from lorakit.data.buckets import batches, fit, make_buckets, nearest_bucket


def test_buckets_hold_the_pixel_budget_with_patch_multiples():
    bs = make_buckets(1024, patch=16, min_side=512, max_side=2048)
    assert (1024, 1024) in bs
    assert all(w % 16 == 0 and h % 16 == 0 and w * h <= 1024 * 1024 for w, h in bs)
    assert all(w * h >= 0.9 * 1024 * 1024 for w, h in bs)  # close to the budget, not tiny
    assert all((h, w) in bs for w, h in bs)


def test_every_bucket_has_a_token_count_that_is_a_multiple_of_8_and_the_aspect_ratios_stay_dense():
    """Compiled attention keeps "length a multiple of 8" fixed: buckets of both kinds compiled every block twice."""
    import itertools
    import math

    for resolution, patch, gap in ((512, 16, 0.14), (1024, 16, 0.08), (1328, 16, 0.08), (1024, 32, 0.14),
                                   (768, 32, 0.1)):
        bs = make_buckets(resolution, patch=patch)
        aligned = all((w // patch) * (h // patch) % 8 == 0 for w, h in bs)
        assert aligned == (resolution // patch >= 32), resolution  # a 24x24 grid: sides only, ratios stay dense
        ratios = sorted({math.log(w / h) for w, h in bs if abs(math.log(w / h)) < 0.7})
        assert max(b - a for a, b in itertools.pairwise(ratios)) < gap, resolution  # up to 2:1, no wide hole
    b = nearest_bucket((848, 1232), make_buckets(1024))  # was 848x1232 itself: 4081 tokens
    assert b == (832, 1216) and abs(b[0] / b[1] - 848 / 1232) < 0.005  # 3952 tokens, the same shape within 0.5%


def test_nearest_bucket_and_fit():
    bs = make_buckets(512, min_side=256, max_side=1024)
    b = nearest_bucket((1920, 1080), bs)
    assert abs(b[0] / b[1] - 16 / 9) < 0.1
    out = fit(Image.new("RGB", (1920, 1080)), b)
    assert out.size == b


def test_batches_never_mix_buckets_and_are_deterministic():
    keys = {f"i{n}": ((512, 512) if n % 3 else (768, 320)) for n in range(20)}
    bs = batches(keys, 4, seed=1)
    assert all(len({keys[k] for k in b}) == 1 for b in bs)
    assert sorted(k for b in bs for k in b) == sorted(keys)
    assert bs == batches(keys, 4, seed=1) and bs != batches(keys, 4, seed=2)
