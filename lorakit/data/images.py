"""Opening images as lorakit trains on them: 8-bit RGB, EXIF orientation applied, every pixel format either mapped
without guessing or refused with the reason (16-bit scaled, float 0..1 scaled, HDR refused; transparency composited
on white; an animated GIF/WebP is a clip, not an image)."""

from __future__ import annotations

from pathlib import Path

from lorakit.errors import InputError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")


class PixelError(InputError):
    """An image whose pixel values lorakit cannot map to 8 bits without guessing."""


def _to_8bit(im, path: Path):
    """16-bit, 32-bit integer and float single-channel images as 8-bit "L", scaled by their bit depth."""
    import numpy as np
    from PIL import Image

    if im.mode.startswith("I;16"):  # 16-bit unsigned: scale, do not clip
        arr = np.asarray(im).astype(np.float64)
        return Image.fromarray(np.round(arr / 257.0).astype(np.uint8), "L")
    if im.mode == "I":
        arr = np.asarray(im)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 65535:
            raise PixelError(f"{path}: 32-bit integer pixels from {lo} to {hi}: their scale cannot be known",
                             "save it as an 8- or 16-bit PNG")
        scale = 257.0 if hi > 255 else 1.0  # 16-bit data (values past 255), else 8-bit values in a wide container
        return Image.fromarray(np.round(arr.astype(np.float64) / scale).astype(np.uint8), "L")
    if im.mode == "F":
        arr = np.asarray(im).astype(np.float64)
        if not np.isfinite(arr).all():
            raise PixelError(f"{path}: float pixels that are NaN or infinite", "save it as an 8- or 16-bit PNG")
        lo, hi = float(arr.min()), float(arr.max())
        if lo >= 0 and hi <= 1:
            return Image.fromarray(np.round(arr * 255).astype(np.uint8), "L")
        if lo >= 0 and hi <= 255 and np.array_equal(arr, np.round(arr)):  # 8-bit values stored as floats
            return Image.fromarray(arr.astype(np.uint8), "L")
        raise PixelError(f"{path}: float pixels from {lo:g} to {hi:g}: neither 0..1 nor whole 0..255 values "
                         "(HDR or linear data?), so their scale cannot be known",
                         "tone-map it to 0..1 or save an 8-bit PNG")
    return im


def has_alpha(path: Path) -> bool:
    """Whether an image file carries transparency (an alpha channel or a transparent palette entry)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (im.mode == "P" and "transparency" in im.info)


def open_alpha(path: Path):
    """The alpha channel of an image file as an 8-bit L image, EXIF orientation applied."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        im.load()
        return _to_8bit(im, Path(path)).convert("RGBA").getchannel("A")


def open_image(path: Path):
    """An 8-bit RGB PIL image with EXIF orientation applied (alpha composited on white).

    Raises:
        PixelError: pixel data whose 8-bit meaning cannot be known (see the module docstring).
    """
    from PIL import Image, ImageOps

    path = Path(path)
    with Image.open(path) as im:
        if getattr(im, "n_frames", 1) > 1 and im.format in ("GIF", "WEBP", "PNG"):
            raise PixelError(f"{path}: an animated {im.format} ({im.n_frames} frames) is a clip, not an image",
                             "use a still image here (video families take clips)")
        im = ImageOps.exif_transpose(im)
        im.load()
        im = _to_8bit(im, path)
        if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (im.mode == "P" and "transparency" in im.info):
            im = im.convert("RGBA")
            bg = Image.new("RGB", im.size, (255, 255, 255))
            bg.paste(im, mask=im.getchannel("A"))
            return bg
        return im.convert("RGB")
