"""Aspect-ratio buckets at a pixel budget, and batches that never mix buckets.

Buckets hold about resolution² pixels, sides multiples of the family's patch (16 px: VAE factor 8 x
patch 2) between min_side and max_side, and a token count (patches per image) that is a multiple of 8:
torch's compiler keeps "attention length a multiple of 8" fixed in a compiled block, so data with both
kinds compiled every block twice — FLUX.1-dev at 24 GiB on an H200 (2026-11-30): 848x1232 (4081 tokens)
beside 1024² (4096), 35.0 s more compiling after step 1, 4 more graphs. A width whose aligned height
loses more than 8% of the pixels is left out (a neighbouring width holds that aspect ratio); the steps
between aspect ratios stay under 0.14 in log ratio (64-pixel steps at 1024²: 0.125). Where the patch grid
is under 32x32 (768 px at a 32 px patch) aligned buckets would be too few: sides only, as before.
An image goes to the bucket nearest its aspect ratio (in log space), is resized to cover it and
centre-cropped (POLICY, recorded in the cache manifest).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

POLICY = "resize-to-cover, center-crop, lanczos"
TOKEN_MULTIPLE = 8  # a bucket's patches per image
KEEP = 0.92  # an aligned height keeps at least this share of the width's largest height
MIN_GRID = 32  # patches per side at the budget from which buckets are aligned


def make_buckets(resolution: int, patch: int = 16, min_side: int = 256, max_side: int = 2048) -> list[tuple[int, int]]:
    """(width, height) pairs with width*height <= resolution² and (width/patch)*(height/patch) a multiple of
    TOKEN_MULTIPLE (grids of MIN_GRID or more), sorted by aspect ratio."""
    budget = resolution * resolution
    multiple = TOKEN_MULTIPLE if resolution // patch >= MIN_GRID else 1
    out = set()
    w = max(patch, (min_side // patch) * patch)
    while w <= max_side:
        rows = min((budget // w) // patch * patch, max_side) // patch
        step = multiple // math.gcd(w // patch, multiple)  # rows must be a multiple of this
        h = (rows - rows % step) * patch
        if h >= min_side and h >= KEEP * rows * patch:
            out.add((w, h))
            out.add((h, w))
        w += patch
    if not out:
        side = max(patch, min(resolution, max_side) // patch * patch)
        out.add((side, side))
    return sorted(out, key=lambda b: (b[0] / b[1], b[0]))


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's (ties: the larger area)."""
    r = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - r), -b[0] * b[1]))


def fit(image, bucket: tuple[int, int]):
    """Resize a PIL image to cover `bucket`, then centre-crop to it."""
    from PIL import Image

    w, h = image.size
    bw, bh = bucket
    scale = max(bw / w, bh / h)
    nw, nh = max(bw, round(w * scale)), max(bh, round(h * scale))
    im = image.resize((nw, nh), Image.LANCZOS)
    left, top = (nw - bw) // 2, (nh - bh) // 2
    return im.crop((left, top, left + bw, top + bh))


def batches(bucket_of: dict[str, tuple[int, int]], batch_size: int, seed: int, drop_last: bool = False):
    """Shuffled batches of item keys; every batch is from one bucket."""
    rng = random.Random(seed)
    groups: dict[tuple[int, int], list[str]] = defaultdict(list)
    for key, b in sorted(bucket_of.items()):
        groups[b].append(key)
    out = []
    for b in sorted(groups):
        keys = groups[b]
        rng.shuffle(keys)
        for i in range(0, len(keys), batch_size):
            chunk = keys[i:i + batch_size]
            if len(chunk) == batch_size or not drop_last:
                out.append(chunk)
    rng.shuffle(out)
    return out
