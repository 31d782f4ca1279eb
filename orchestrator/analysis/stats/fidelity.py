"""Image fidelity across builds: the same seed, prompt and device should give the same image,
within a tolerance measured as PSNR against the series' previous image."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

MIN_PSNR_DB = 30.0  # below this an image counts as changed (a fidelity alert)

ImageLike = np.ndarray | str | os.PathLike


def load_image(image: ImageLike) -> np.ndarray:
    """An (H, W, 3) uint8 array from an array or a PNG path (converted to RGB)."""
    if isinstance(image, np.ndarray):
        a = image
    else:
        from PIL import Image

        with Image.open(image) as im:
            a = np.asarray(im.convert("RGB"))
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {a.dtype} {a.shape}")
    return a


def psnr(a: ImageLike, b: ImageLike) -> float:
    """10 log10(255^2 / MSE) in dB over all pixels and channels; inf for identical images."""
    x, y = load_image(a), load_image(b)
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {x.shape} vs {y.shape}; a resolution change is a new series")
    mse = float(np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


class ImageCheck(NamedTuple):
    """A tuple (psnr_db, changed), so `value, changed = compare_images(a, b)` works."""

    psnr_db: float
    changed: bool


def compare_images(previous: ImageLike, current: ImageLike, *, min_psnr_db: float = MIN_PSNR_DB) -> ImageCheck:
    """(psnr, changed): changed when the PSNR is below `min_psnr_db`."""
    value = psnr(previous, current)
    return ImageCheck(value, value < min_psnr_db)
