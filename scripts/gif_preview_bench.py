"""The GIF preview `lorakit infer` writes beside a clip: Pillow's own conversion against `data.video.gif_frame`, on a
121-frame 1024x576 test pattern (a moving gradient with noise), on this host.

    .venv/bin/python scripts/gif_preview_bench.py
"""

import os
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

from lorakit.data.video import write_clip


def main() -> None:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:576, 0:1024]
    frames = []
    for t in range(121):
        a = np.stack([(xx + 4 * t) % 256, (yy + 2 * t) % 256, (xx + yy + t) % 256], -1)
        frames.append(Image.fromarray(np.clip(a + rng.integers(-8, 8, a.shape), 0, 255).astype(np.uint8)))

    def db(path, k=60):
        g = Image.open(path)
        g.seek(k)
        err = (np.asarray(g.convert("RGB"), float) - np.asarray(frames[k], float)) ** 2
        return 10 * np.log10(255**2 / err.mean())

    with tempfile.TemporaryDirectory() as d:
        old, new = os.path.join(d, "old.gif"), os.path.join(d, "new.gif")
        t = time.perf_counter()
        frames[0].save(old, format="GIF", save_all=True, append_images=frames[1:], duration=42, loop=0)
        pillow = time.perf_counter() - t
        ours = []
        for _ in range(3):
            t = time.perf_counter()
            write_clip(new, frames, fps=24)
            ours.append(time.perf_counter() - t)
        print(f"Pillow's conversion: {pillow:.1f} s, {db(old):.1f} dB from the frame, {os.path.getsize(old) / 1e6:.1f} MB")
        print(f"gif_frame: {statistics.median(ours):.1f} s (median of 3), {db(new):.1f} dB, "
              f"{os.path.getsize(new) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
