"""Aspect-ratio buckets at a pixel budget, and batches that never mix buckets.

Buckets hold about resolution² pixels, sides multiples of the family's patch (16 px: VAE factor 8 x
patch 2) between min_side and max_side. An image goes to the bucket nearest its aspect ratio (in log
space), is resized to cover it and centre-cropped (POLICY, recorded in the cache manifest).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

POLICY = "resize-to-cover, center-crop, lanczos"


def make_buckets(resolution: int, patch: int = 16, min_side: int = 256, max_side: int = 2048) -> list[tuple[int, int]]:
    """(width, height) pairs with width*height <= resolution², sorted by aspect ratio."""
    budget = resolution * resolution
    out = set()
    w = max(patch, (min_side // patch) * patch)
    while w <= max_side:
        h = min((budget // w) // patch * patch, max_side)
        if h >= min_side:
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
