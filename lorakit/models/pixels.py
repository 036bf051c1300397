"""Images as the VAEs take them."""

from __future__ import annotations


def to_pixels(images):
    """PIL RGB images of one size -> (B, 3, H, W) float32 in [-1, 1], with the arithmetic of diffusers'
    VaeImageProcessor (x / 255, then 2x - 1) bit for bit, and its channels-last strides."""
    import numpy as np
    import torch

    arr = np.stack([np.asarray(im).astype(np.float32) / 255.0 for im in images])
    arr = 2.0 * arr - 1.0
    return torch.from_numpy(arr.transpose(0, 3, 1, 2))
