"""Crop geometry: torchvision's RandomResizedCrop and Resize+CenterCrop boxes, as numpy."""

from __future__ import annotations

import math

import numpy as np

from raying.image import exif as _exif

# Columns of the per-sample uniform draws (see raying.image.rng.uniforms).
RRC_ATTEMPTS = 10
DRAW_SCALE = 0  # columns 0..9: area fraction of each attempt
DRAW_LOG_RATIO = RRC_ATTEMPTS  # columns 10..19: log aspect ratio of each attempt
DRAW_TOP = 2 * RRC_ATTEMPTS  # column 20: top offset
DRAW_LEFT = DRAW_TOP + 1  # column 21: left offset
DRAW_FLIP = DRAW_TOP + 2  # column 22: horizontal flip
N_DRAWS = DRAW_TOP + 3


def random_resized_boxes(heights: np.ndarray, widths: np.ndarray, draws: np.ndarray,
                         scale: tuple[float, float],
                         ratio: tuple[float, float]) -> np.ndarray:
    """torchvision's ``RandomResizedCrop.get_params`` for many images at once.

    Each image gets ``RRC_ATTEMPTS`` candidate boxes of area ``uniform(*scale) * H * W`` and
    aspect ratio ``exp(uniform(log(ratio)))``; the first that fits wins and its offset is
    uniform. When none fits, the fallback is torchvision's: a centre crop of the whole image
    with the aspect ratio clamped into ``ratio``.

    Args:
        heights: (n,) int image heights (> 0).
        widths: (n,) int image widths (> 0).
        draws: (n, N_DRAWS) uniforms in [0, 1).
        scale: (min, max) fraction of the image area.
        ratio: (min, max) aspect ratio, width / height.

    Returns:
        (n, 4) int64 boxes ``(top, left, height, width)``.
    """
    h = heights.astype(np.float64)
    w = widths.astype(np.float64)
    area = (h * w)[:, None]
    frac = scale[0] + draws[:, DRAW_SCALE:DRAW_SCALE + RRC_ATTEMPTS] * (scale[1] - scale[0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(log_lo + draws[:, DRAW_LOG_RATIO:DRAW_LOG_RATIO + RRC_ATTEMPTS]
                    * (log_hi - log_lo))
    target = area * frac
    # np.rint rounds half to even, like Python's round() in torchvision.
    crop_w = np.rint(np.sqrt(target * aspect))
    crop_h = np.rint(np.sqrt(target / aspect))
    fits = (crop_w > 0) & (crop_w <= w[:, None]) & (crop_h > 0) & (crop_h <= h[:, None])
    rows = np.arange(len(h))
    first = fits.argmax(axis=1)
    hit = fits[rows, first]
    box_h = crop_h[rows, first]
    box_w = crop_w[rows, first]
    top = np.floor(draws[:, DRAW_TOP] * (h - box_h + 1))
    left = np.floor(draws[:, DRAW_LEFT] * (w - box_w + 1))
    if not hit.all():
        miss = ~hit
        fb_h, fb_w = _ratio_clamped(h[miss], w[miss], ratio)
        box_h[miss] = fb_h
        box_w[miss] = fb_w
        top[miss] = np.floor((h[miss] - fb_h) / 2)
        left[miss] = np.floor((w[miss] - fb_w) / 2)
    return np.stack([top, left, box_h, box_w], axis=1).astype(np.int64)


def _ratio_clamped(h: np.ndarray, w: np.ndarray,
                   ratio: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's fallback box size: the whole image, aspect ratio clamped into range."""
    in_ratio = w / h
    narrow = in_ratio < ratio[0]
    wide = in_ratio > ratio[1]
    out_h = np.where(narrow, np.clip(np.rint(w / ratio[0]), 1, h), h)
    out_w = np.where(wide, np.clip(np.rint(h * ratio[1]), 1, w), w)
    return out_h, out_w


def center_boxes(heights: np.ndarray, widths: np.ndarray, size: int, resize: int) -> np.ndarray:
    """Source boxes of torchvision's ``Resize(resize)`` then ``CenterCrop(size)``.

    Resizing the shorter side to ``resize`` (the longer one to ``int(resize * long /
    short)``) and cropping the centre ``size`` x ``size`` samples the source where resampling
    the box returned here to ``size`` x ``size`` does: the box is exact, in fractions of a
    source pixel (a whole-pixel box was off by up to half a source pixel, one to three
    output pixels for an image smaller than ``size``).

    Returns:
        (n, 4) float64 boxes ``(top, left, height, width)``.
    """
    h = heights.astype(np.float64)
    w = widths.astype(np.float64)
    tall = h > w
    short = np.minimum(h, w)
    long_resized = np.floor(resize * np.maximum(h, w) / short)
    resized_h = np.where(tall, long_resized, resize)
    resized_w = np.where(tall, resize, long_resized)
    # torchvision's CenterCrop: int(round((resized - size) / 2.0)).
    top_r = np.rint((resized_h - size) / 2.0)
    left_r = np.rint((resized_w - size) / 2.0)
    fy = h / resized_h
    fx = w / resized_w
    box_h = np.minimum(size * fy, h)
    box_w = np.minimum(size * fx, w)
    top = np.clip(top_r * fy, 0, h - box_h)
    left = np.clip(left_r * fx, 0, w - box_w)
    return np.stack([top, left, box_h, box_w], axis=1)


def halvings(crop_h: float, crop_w: float, size: int) -> int:
    """How many times the crop halves before its short side falls under ``size``: the 2x
    reductions (libjpeg's DCT scaling gives the first three) that leave the final resample
    shrinking by less than 2x, so that it does not alias (a JPEG decoded at
    ``8 >> min(halvings, 3)`` eighths, then halved for the rest)."""
    short = min(crop_h, crop_w)
    k = 0
    while short >= 2 * size:
        short /= 2
        k += 1
    return k


def inverse_map(box, flip, size: int, orientation: int, stored_h: int, stored_w: int,
                 scale: float) -> np.ndarray:
    """The 2x3 matrix taking an output pixel to the source pixel it samples.

    ``box`` (top, left, height, width) is on the upright image in pixel-edge units; the
    output is optionally mirrored; the upright image is the stored one turned by the EXIF
    ``orientation`` (stored size ``stored_h`` x ``stored_w``); the source is the stored image
    scaled by ``scale``. Sub-pixel exact, so a reduced decode samples the same places as a
    full one (a rounded crop of a 1/8-scale image would be off by up to 4 full-size pixels).
    """
    top, left, box_h, box_w = box
    flip_rows, flip_cols, transpose = _exif.ORIENTATION_OPS.get(orientation,
                                                                _exif.ORIENTATION_OPS[1])
    step_y = box_h / size
    step_x = box_w / size

    def source(u: float, v: float) -> tuple[float, float]:
        if flip:
            v = size - 1 - v
        y = top + (u + 0.5) * step_y
        x = left + (v + 0.5) * step_x
        if transpose:
            y, x = x, y
        if flip_rows:
            y = stored_h - y
        if flip_cols:
            x = stored_w - x
        return y * scale - 0.5, x * scale - 0.5

    r00, c00 = source(0.0, 0.0)
    r01, c01 = source(0.0, 1.0)
    r10, c10 = source(1.0, 0.0)
    return np.array([[c01 - c00, c10 - c00, c00], [r01 - r00, r10 - r00, r00]])
