"""Single-core ms/image of decode + random-resized-crop + flip: raying's path vs a naive loop.

Run: ``python -m raying.bench.decode_profile [--n 256] [--reps 7] [--source synth|photo]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import cv2
import numpy as np
import simplejpeg

from raying.image.transform import ImageTransform

SHAPES = {"256x256": (256, 256), "500x375": (375, 500), "1024x768": (768, 1024)}
DEFAULT_SHAPES = ("256x256", "500x375")


def _images(shape: tuple[int, int], n: int, seed: int, subsampling: str,
            source: str = "synth") -> list[bytes]:
    """JPEGs (quality 90): raying.tools.datagen's synthetic images, or crops of a real photo."""
    rng = np.random.default_rng(seed)
    h, w = shape
    if source == "photo":  # matplotlib's sample photo, resampled differently for each image
        import matplotlib.cbook

        with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as fh:  # type: ignore[union-attr]
            photo = simplejpeg.decode_jpeg(fh.read(), "RGB")
        out = []
        for _ in range(n):
            frac = rng.uniform(0.6, 1.0)
            ch = min(photo.shape[0], int(photo.shape[1] * frac * h / w))
            cw = int(ch * w / h)
            top = int(rng.integers(0, photo.shape[0] - ch + 1))
            left = int(rng.integers(0, photo.shape[1] - cw + 1))
            img = cv2.resize(photo[top:top + ch, left:left + cw], (w, h),
                             interpolation=cv2.INTER_AREA)
            out.append(simplejpeg.encode_jpeg(img[:, ::-1].copy() if rng.random() < 0.5
                                              else img, quality=90, colorspace="RGB",
                                              colorsubsampling=subsampling))
        return out
    from raying.tools.datagen import synth_image

    return [simplejpeg.encode_jpeg(synth_image(rng, i % 10, 10, h, w), quality=90,
                                   colorspace="RGB", colorsubsampling=subsampling)
            for i in range(n)]


def _rrc(rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, one image at a time (the naive way)."""
    area = h * w
    log_r = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ar = math.exp(rng.uniform(*log_r))
        cw = int(round(math.sqrt(target * ar)))
        ch = int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    return 0, 0, h, w


def naive_loop(datas: list[bytes], size: int, rng: np.random.Generator) -> np.ndarray:
    """Full decode, crop, cv2.resize, flip, stack: what a hand-written loop does."""
    out = []
    for d in datas:
        img = simplejpeg.decode_jpeg(d, "RGB")
        top, left, ch, cw = _rrc(rng, img.shape[0], img.shape[1])
        img = cv2.resize(img[top:top + ch, left:left + cw], (size, size),
                         interpolation=cv2.INTER_LINEAR)
        if rng.random() < 0.5:
            img = cv2.flip(img, 1)
        out.append(img)
    return np.stack(out)


def tight_loop(datas: list[bytes], boxes: list, flips: list, size: int,
               out: np.ndarray) -> None:
    """The limit: full decode, crop view, cv2.resize into a preallocated slot, in-place flip.

    Crop boxes are drawn beforehand (not timed), so only the per-image work is measured.
    """
    for i, d in enumerate(datas):
        img = simplejpeg.decode_jpeg(d, "RGB")
        top, left, ch, cw = boxes[i]
        cv2.resize(img[top:top + ch, left:left + cw], (size, size), dst=out[i],
                   interpolation=cv2.INTER_LINEAR)
        if flips[i]:
            cv2.flip(out[i], 1, dst=out[i])


def decode_only(datas: list[bytes]) -> None:
    """The floor: libjpeg-turbo full decodes and nothing else."""
    for d in datas:
        simplejpeg.decode_jpeg(d, "RGB")


def profile(n: int = 256, reps: int = 7, size: int = 224, seed: int = 0,
            subsampling: str = "420", source: str = "synth",
            shapes: tuple[str, ...] = DEFAULT_SHAPES) -> dict[str, dict[str, float]]:
    """Median ms/image on one core for each source shape and each way of doing the work.

    Keys are ways of doing it; values are CPU ms/image of the calling thread (everything runs
    on it: cv2 is set to one thread), and ``<way>_wall`` the wall-clock ms/image. The ways
    are interleaved round-robin within each repetition, so background load hits them alike.
    """
    cv2.setNumThreads(1)
    transform = ImageTransform(size=size)
    results: dict[str, dict[str, float]] = {}
    for name in shapes:
        shape = SHAPES[name]
        datas = _images(shape, n, seed, subsampling, source)
        ids = np.arange(n, dtype=np.int64)
        out = np.empty((n, size, size, 3), dtype=np.uint8)
        rng = np.random.default_rng(seed)
        decoded = [simplejpeg.decode_jpeg(d, "RGB") for d in datas]
        boxes, flips = transform.crop_params(np.full(n, shape[0]), np.full(n, shape[1]), ids,
                                             seed=seed, epoch=0)
        box_list, flip_list = boxes.tolist(), flips.tolist()
        ways = {
            "decode_only": lambda e, d=datas: decode_only(d),
            "naive_loop": lambda e, d=datas, r=rng: naive_loop(d, size, r),
            "tight_loop": lambda e, d=datas, b=box_list, f=flip_list, o=out:
                tight_loop(d, b, f, size, o),
            "raying_apply_encoded": lambda e, d=datas, i=ids, o=out: transform.apply_encoded(
                d, i, seed=seed, epoch=e, out=o),
            "raying_apply_decoded": lambda e, d=decoded, i=ids, o=out: transform.apply_decoded(
                d, i, seed=seed, epoch=e, out=o),
        }
        cpu: dict[str, list[float]] = {k: [] for k in ways}
        wall: dict[str, list[float]] = {k: [] for k in ways}
        for rep in range(reps):
            for key, fn in ways.items():
                c0, w0 = time.thread_time(), time.perf_counter()
                fn(rep)  # type: ignore[operator]
                cpu[key].append(time.thread_time() - c0)
                wall[key].append(time.perf_counter() - w0)
        row = {k: 1e3 * float(np.median(v)) / n for k, v in cpu.items()}
        row.update({f"{k}_wall": 1e3 * float(np.median(v)) / n for k, v in wall.items()})
        row["bytes_per_image"] = float(np.mean([len(d) for d in datas]))
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> None:
    """Print (and optionally save) the profile."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python -m raying.bench.decode_profile --n 256 --reps 7")
    parser.add_argument("--n", type=int, default=256, help="images per shape")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (median)")
    parser.add_argument("--subsampling", default="420", help="JPEG chroma subsampling")
    parser.add_argument("--source", choices=("synth", "photo"), default="synth",
                        help="raying.tools.datagen images, or crops of matplotlib's sample photo")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as a read task
    results = profile(args.n, args.reps, subsampling=args.subsampling, source=args.source,
                      shapes=tuple(args.shapes.split(",")))
    for name, row in results.items():
        cells = "  ".join(f"{k}={v:.3f}" for k, v in row.items()
                          if k != "bytes_per_image" and not k.endswith("_wall"))
        walls = "  ".join(f"{k}={v:.3f}" for k, v in row.items() if k.endswith("_wall"))
        print(f"{name} ({row['bytes_per_image'] / 1024:.1f} KiB) CPU ms/image: {cells}")
        print(f"    wall ms/image: {walls}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
