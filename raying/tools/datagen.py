"""Generated image datasets for the demo, benchmarks and tests (deterministic from a seed)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def class_colour(label: int, n_classes: int) -> np.ndarray:
    """A distinct mean colour per class (uint8 RGB)."""
    hue = (label / max(n_classes, 1)) * 6.0
    c = np.clip(np.abs(((hue + np.array([0.0, 4.0, 2.0])) % 6.0) - 3.0) - 1.0, 0.0, 1.0)
    return (40 + 175 * c).astype(np.uint8)


def synth_image(rng: np.random.Generator, label: int, n_classes: int, h: int, w: int,
                *, noise: float = 5.0) -> np.ndarray:
    """An HxWx3 uint8 image: class colour, smooth random texture and a little noise.

    It compresses like a photo (~0.3 bytes/pixel at JPEG quality 90), so decode costs are
    realistic, unlike pure noise or flat colour.
    """
    base = class_colour(label, n_classes).astype(np.float32)
    gh, gw = max(2, h // 32), max(2, w // 32)
    grid = rng.normal(0.0, 40.0, size=(gh, gw, 3)).astype(np.float32)
    import cv2

    texture = cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC)
    img = base + texture + rng.normal(0.0, noise, size=(h, w, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(img: np.ndarray, fmt: str, quality: int = 90) -> bytes:
    """JPEG (libjpeg-turbo) or PNG bytes of an RGB image."""
    if fmt in ("jpg", "jpeg"):
        import simplejpeg

        return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality,
                                      colorspace="RGB")
    import cv2

    ok, buf = cv2.imencode(f".{fmt}", img[:, :, ::-1])
    if not ok:  # pragma: no cover
        msg = f"could not encode {fmt}"
        raise ValueError(msg)
    return buf.tobytes()


def make_image_folder(root: str | os.PathLike, *, n: int, classes: int = 10,
                      size: tuple[int, int] = (256, 256), seed: int = 0,
                      formats: tuple[str, ...] = ("jpg",), quality: int = 90) -> Path:
    """Write ``n`` images into ``root/class_XX/NNNNNN.<fmt>`` (formats alternate).

    Returns the root. Existing files of the same name are overwritten.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    h, w = size
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        label = i % classes
        fmt = formats[i % len(formats)]
        img = synth_image(rng, label, classes, h, w)
        (root / f"class_{label:02d}" / f"{i:06d}.{fmt}").write_bytes(encode(img, fmt, quality))
    return root


def imagenet_like_shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(height, width) of ``n`` photos sized like ImageNet's: mostly 4:3 landscape, some
    portrait and square, sides within 300-800 px, mean near 500x375."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        long = int(np.clip(rng.normal(520, 90), 300, 800))
        kind = rng.random()
        ratio = 1.0 if kind < 0.05 else float(rng.uniform(1.25, 1.5))
        short = int(np.clip(round(long / ratio), 300, 800))
        out.append((long, short) if 0.05 <= kind < 0.15 else (short, long))
    return out


def write_varied_jpeg(path: str | os.PathLike, rng: np.random.Generator, label: int,
                      n_classes: int, h: int, w: int) -> None:
    """One JPEG as a photo collection varies: quality 75-95, ~10% grayscale, ~10%
    progressive (written by PIL), the rest baseline (libjpeg-turbo via simplejpeg)."""
    img = synth_image(rng, label, n_classes, h, w)
    quality = int(rng.integers(75, 96))
    kind = rng.random()
    if kind < 0.1:
        gray = np.ascontiguousarray(img.mean(axis=2).astype(np.uint8)[..., None])
        import simplejpeg

        data = simplejpeg.encode_jpeg(gray, quality=quality, colorspace="GRAY")
    elif kind < 0.2:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality, progressive=True)
        data = buf.getvalue()
    else:
        data = encode(img, "jpg", quality)
    Path(path).write_bytes(data)


def make_imagenet_like_folder(root: str | os.PathLike, *, n: int, classes: int = 10,
                              seed: int = 0, start: int = 0, stop: int | None = None) -> Path:
    """Write images ``start..stop`` of an ``n``-image ImageNet-like folder into
    ``root/class_XX/NNNNNN.jpg`` (sizes from :func:`imagenet_like_shapes`); each image's
    pixels depend only on (seed, index), so parts written by several processes make one set."""
    root = Path(root)
    shapes = imagenet_like_shapes(n, seed)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(start, n if stop is None else stop):
        label = i % classes
        h, w = shapes[i]
        rng = np.random.default_rng([seed, i])
        write_varied_jpeg(root / f"class_{label:02d}" / f"{i:06d}.jpg", rng, label, classes,
                          h, w)
    return root
