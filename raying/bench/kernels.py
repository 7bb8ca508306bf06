"""The per-image work of the user-written peers and the limit: decode, random crop, flip.

Written as a careful user would, with the fast libraries: libjpeg-turbo through simplejpeg
(full-size decode), torchvision's RandomResizedCrop box drawn per image with numpy, the crop
resized by ``cv2.resize`` (bilinear) straight into the output slot, then a 50% horizontal
flip. ``raying`` itself uses its own ``ImageTransform`` and tf.data its native ops.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
import simplejpeg

CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
_LOG_RATIO = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))


def decode(data) -> np.ndarray:
    """JPEG bytes -> HxWx3 uint8 RGB (libjpeg-turbo)."""
    return simplejpeg.decode_jpeg(data, colorspace="RGB")


def rrc_box(rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (top, left, height, width)."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(*CROP_SCALE)
        aspect = math.exp(rng.uniform(*_LOG_RATIO))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    in_ratio = w / h
    if in_ratio < CROP_RATIO[0]:
        cw, ch = w, int(round(w / CROP_RATIO[0]))
    elif in_ratio > CROP_RATIO[1]:
        ch, cw = h, int(round(h * CROP_RATIO[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def resized_crop_flip(img: np.ndarray, rng: np.random.Generator, out: np.ndarray) -> None:
    """Random-resized-crop of ``img`` into ``out`` (size x size x 3 uint8), 50% mirrored."""
    top, left, ch, cw = rrc_box(rng, img.shape[0], img.shape[1])
    size = out.shape[0]
    cv2.resize(img[top:top + ch, left:left + cw], (size, size), dst=out,
               interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        cv2.flip(out, 1, dst=out)


def crop_flip(img: np.ndarray, rng: np.random.Generator, out: np.ndarray) -> None:
    """Plain random crop of ``out``'s size (no resize) into ``out``, 50% mirrored (W4)."""
    size = out.shape[0]
    top = int(rng.integers(0, img.shape[0] - size + 1))
    left = int(rng.integers(0, img.shape[1] - size + 1))
    view = img[top:top + size, left:left + size]
    if rng.random() < 0.5:
        out[...] = view[:, ::-1]
    else:
        out[...] = view


def decode_crop_flip(data, rng: np.random.Generator, out: np.ndarray) -> None:
    """Decode JPEG bytes, then :func:`resized_crop_flip` into ``out``."""
    resized_crop_flip(decode(data), rng, out)


# W7's user augmentation: a colour jitter (brightness, contrast, saturation), ~0.3 ms per 224 px
# image on one core with one BLAS thread, applied by every peer in its own idiom.
JITTER = 0.4
_GRAY = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def jitter_factors(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 3) brightness, contrast and saturation factors, each uniform in 1 +- JITTER."""
    return rng.uniform(1.0 - JITTER, 1.0 + JITTER, size=(n, 3)).astype(np.float32)


def colour_jitter(images: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """torchvision's ColorJitter(0.4, 0.4, 0.4) math on an (n, H, W, 3) uint8 batch, in float32:
    scale by brightness, blend with the image mean by contrast, blend with the grayscale
    image by saturation, clip; returns uint8 of the same shape."""
    x = images.astype(np.float32)
    x *= factors[:, 0, None, None, None]
    np.clip(x, 0, 255, out=x)
    mean = (x @ _GRAY).mean(axis=(1, 2))[:, None, None, None]
    x -= mean
    x *= factors[:, 1, None, None, None]
    x += mean
    np.clip(x, 0, 255, out=x)
    gray = (x @ _GRAY)[..., None]
    x -= gray
    x *= factors[:, 2, None, None, None]
    x += gray
    np.clip(x, 0, 255, out=x)
    return x.astype(np.uint8)


def jitter_batch(batch: dict, rng: np.random.Generator) -> dict:
    """``colour_jitter`` as a batch stage: a dict with ``image`` in, the same dict out."""
    batch["image"] = colour_jitter(batch["image"], jitter_factors(rng, len(batch["image"])))
    return batch
