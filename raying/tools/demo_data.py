"""The demo's generated dataset: ten shape classes, three of them rare and subtle, plus bad files."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from raying.errors import ConfigError

# Where `raying demo` caches its dataset unless --data says otherwise.
DEFAULT_DEMO_DATA_DIR = os.path.join("~", ".cache", "raying", "demo-data")
# Bump when the renderer changes, so stale caches are regenerated.
_GENERATOR_VERSION = 1

# Class k draws shape CLASS_SHAPES[k]. The last three are the rare, hard classes: each is a
# small change to a common class (a dot cut into a disc, a slit across a square, a plus that
# lost its lower arm), so a model that has not seen enough of them calls them by their
# common look-alike.
CLASS_SHAPES = ("disc", "square", "triangle", "bar", "ring", "plus", "diamond",
                "holed_disc", "slit_square", "tee")
LOOKALIKE = {7: 0, 8: 1, 9: 5}


@dataclasses.dataclass(frozen=True)
class DemoDataSpec:
    """What to generate; the cache folder is keyed by these fields.

    Args:
        common_per_class: training images of each of the seven common classes.
        rare_per_class: training images of each of the three rare classes.
        val_per_class: validation images per class (the validation set is balanced).
        size: image height and width in pixels.
        noise: pixel noise (std, 0-255 scale) of the common classes.
        rare_noise: pixel noise of the rare classes (they are harder).
        bad_files: add a truncated JPEG, a zero-byte file and a non-image to the train set.
        seed: the seed of everything drawn.
    """

    common_per_class: int = 600
    rare_per_class: int = 20
    val_per_class: int = 60
    size: int = 32
    noise: float = 10.0
    rare_noise: float = 16.0
    bad_files: bool = True
    seed: int = 0

    @property
    def rare_classes(self) -> tuple[int, ...]:
        return tuple(LOOKALIKE)

    def key(self) -> str:
        """A short hash of the spec (and the generator's version): the cache's folder name."""
        blob = json.dumps({**dataclasses.asdict(self), "v": _GENERATOR_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class DemoData:
    """A generated dataset on disk.

    Attributes:
        root: the cache folder of this spec.
        train: the training image folder (``class_XX/*.jpg``, imbalanced, with bad files).
        val: the balanced validation image folder.
        spec: what was generated.
        bad_paths: the bad files mixed into ``train`` (relative to it).
        generated: True if this call wrote the files, False if they came from the cache.
    """

    root: Path
    train: Path
    val: Path
    spec: DemoDataSpec
    bad_paths: tuple[str, ...]
    generated: bool

    @property
    def rare_classes(self) -> tuple[int, ...]:
        return self.spec.rare_classes


def _poly(cx: float, cy: float, r: float, angles: np.ndarray, rot: float) -> np.ndarray:
    a = angles + rot
    return np.stack([cx + r * np.cos(a), cy + r * np.sin(a)], axis=1)


def _draw(img: np.ndarray, shape: str, cx: float, cy: float, r: float, rot: float,
          fg: tuple[float, ...], bg: tuple[float, ...]) -> None:
    """Draw one shape, antialiased, with 4 bits of sub-pixel precision."""
    import cv2

    s = 16  # cv2 shift=4: coordinates in 1/16 px

    def pts(p: np.ndarray) -> list[np.ndarray]:
        return [np.round(p * s).astype(np.int32)]

    def circle(x: float, y: float, rad: float, colour, thick: int = -1) -> None:
        cv2.circle(img, (round(x * s), round(y * s)), round(rad * s), colour, thick,
                   cv2.LINE_AA, 4)

    def arm(angle: float, length: float, width: float, colour) -> None:
        d = np.array([math.cos(angle), math.sin(angle)])
        n = np.array([-d[1], d[0]])
        c = np.array([cx, cy])
        quad = np.stack([c - n * width / 2, c - n * width / 2 + d * length,
                         c + n * width / 2 + d * length, c + n * width / 2])
        cv2.fillPoly(img, pts(quad), colour, cv2.LINE_AA, 4)

    if shape in ("disc", "holed_disc"):
        circle(cx, cy, r, fg)
        if shape == "holed_disc":
            circle(cx, cy, r * 0.3, bg)
    elif shape == "ring":
        circle(cx, cy, r * 0.8, fg, max(2, round(r * 0.35)))
    elif shape in ("square", "slit_square"):
        corners = _poly(cx, cy, r * 1.1, np.arange(4) * math.pi / 2 + math.pi / 4, rot)
        cv2.fillPoly(img, pts(corners), fg, cv2.LINE_AA, 4)
        if shape == "slit_square":
            d = np.array([math.cos(rot + math.pi / 4), math.sin(rot + math.pi / 4)]) * r * 1.1
            a, b = np.array([cx, cy]) - d, np.array([cx, cy]) + d
            cv2.line(img, (round(a[0] * s), round(a[1] * s)), (round(b[0] * s), round(b[1] * s)),
                     bg, max(1, round(r * 0.18)), cv2.LINE_AA, 4)
    elif shape == "diamond":
        corners = _poly(cx, cy, r * 1.2, np.arange(4) * math.pi / 2, rot)
        cv2.fillPoly(img, pts(corners), fg, cv2.LINE_AA, 4)
    elif shape == "triangle":
        corners = _poly(cx, cy, r * 1.15, np.arange(3) * 2 * math.pi / 3 - math.pi / 2, rot)
        cv2.fillPoly(img, pts(corners), fg, cv2.LINE_AA, 4)
    elif shape == "bar":
        arm(rot, r, r * 0.7, fg)
        arm(rot + math.pi, r, r * 0.7, fg)
    elif shape in ("plus", "tee"):
        for k in range(4):
            if shape == "tee" and k == 1:  # the lower arm (angle pi/2 points down)
                continue
            arm(rot + k * math.pi / 2, r, r * 0.55, fg)
    else:  # pragma: no cover - CLASS_SHAPES is closed
        msg = f"unknown shape {shape!r}"
        raise ConfigError(msg)


def render(rng: np.random.Generator, label: int, *, size: int, noise: float) -> np.ndarray:
    """One ``size`` x ``size`` RGB image of class ``label``: a shape on a textured background.

    Colours are random (they carry no class information); only the shape does. Position,
    size and a small rotation are jittered.
    """
    import cv2

    bg = rng.uniform(40, 215, size=3)
    grid = rng.normal(0.0, 22.0, size=(3, 3, 3)).astype(np.float32)
    img = (bg + cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC)).astype(np.float32)
    # Foreground: far enough from the background in brightness to be visible.
    shift = rng.uniform(70, 120) * rng.choice([-1.0, 1.0])
    if not 0 <= bg.mean() + shift <= 255:
        shift = -shift
    fg = np.clip(bg + shift + rng.normal(0, 25, size=3), 0, 255)
    canvas = np.zeros((size, size, 3), np.float32)
    mask = np.zeros((size, size, 3), np.float32)
    cx, cy = (size - 1) / 2 + rng.uniform(-0.1, 0.1, size=2) * size
    r = size * rng.uniform(0.24, 0.32)
    rot = rng.uniform(-0.25, 0.25)
    _draw(canvas, CLASS_SHAPES[label], cx, cy, r, rot, tuple(fg.tolist()), (0.0, 0.0, 0.0))
    _draw(mask, CLASS_SHAPES[label], cx, cy, r, rot, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0))
    img = img * (1.0 - mask) + canvas
    img += rng.normal(0.0, noise, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _write_split(root: Path, counts: list[int], spec: DemoDataSpec,
                 rng: np.random.Generator, bar: Any) -> None:
    from raying.tools.datagen import encode

    for label, count in enumerate(counts):
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        noise = spec.rare_noise if label in spec.rare_classes else spec.noise
        for i in range(count):
            img = render(rng, label, size=spec.size, noise=noise)
            (folder / f"{i:05d}.jpg").write_bytes(encode(img, "jpg", quality=92))
            bar.update(1)


def _write_bad_files(train: Path) -> tuple[str, ...]:
    """A truncated JPEG, a zero-byte file and a text file named .jpg: the skip policy's work."""
    good = (train / "class_00" / "00000.jpg").read_bytes()
    bad = {"class_00/bad_truncated.jpg": good[: len(good) // 2],
           "class_01/bad_empty.jpg": b"",
           "class_02/bad_not_an_image.jpg": b"this is a text file, not a JPEG\n"}
    for rel, data in bad.items():
        (train / rel).write_bytes(data)
    return tuple(sorted(bad))


def ensure_demo_data(cache_dir: str | os.PathLike | None = None,
                     spec: DemoDataSpec | None = None, *, progress: bool = False) -> DemoData:
    """Generate the demo dataset once and reuse it: ``<cache_dir>/<spec key>/{train,val}``.

    Generation is deterministic from ``spec.seed``; a folder is only reused when its
    ``spec.json`` was written after the last image (an interrupted run regenerates).

    Args:
        cache_dir: the cache folder; default ``~/.cache/raying/demo-data``.
        spec: what to generate; default :class:`DemoDataSpec()`.
        progress: show a progress bar while generating.

    Returns:
        Where the train and validation folders are.
    """
    spec = spec or DemoDataSpec()
    base = Path(os.path.expanduser(str(cache_dir or DEFAULT_DEMO_DATA_DIR)))
    root = base / f"shapes-{spec.key()}"
    done = root / "spec.json"
    if done.exists():
        return _cached(root, spec)
    # Generated into a private folder and renamed into place once whole: two first runs at
    # once (two `raying demo`, two test workers) then each finish, and the one that renames
    # second takes the first one's folder instead of writing into it.
    try:
        base.mkdir(parents=True, exist_ok=True)
        _remove_stale_work(base, root.name)
        work = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=base))
        os.chmod(work, 0o755)  # as a plain mkdir would leave it, not mkdtemp's 0700
    except OSError as exc:
        msg = (f"cannot write the demo dataset under {base}: {exc.strerror}; pass a writable "
               f"folder with --data")
        raise ConfigError(msg) from None
    try:
        bad = _generate(work, spec, progress)
        # Checking, clearing and renaming under one lock: another run's finished folder is
        # never taken for an interrupted one and removed.
        with _lock(base):
            if done.exists():
                return _cached(root, spec)  # another run finished first: the same data
            if root.exists():
                shutil.rmtree(root, ignore_errors=True)  # an interrupted run (no spec.json)
            os.rename(work, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return DemoData(root, root / "train", root / "val", spec, bad, True)


# A work folder older than this was left by a run that was killed (not one still writing).
STALE_WORK_S = 6 * 3600


def _remove_stale_work(base: Path, name: str) -> None:
    import time

    for entry in base.glob(f".{name}.*"):
        try:
            if entry.is_dir() and time.time() - entry.stat().st_mtime > STALE_WORK_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


@contextlib.contextmanager
def _lock(base: Path) -> Iterator[None]:
    import fcntl

    with open(base / ".lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def _cached(root: Path, spec: DemoDataSpec) -> DemoData:
    meta = json.loads((root / "spec.json").read_text())
    return DemoData(root, root / "train", root / "val", spec, tuple(meta.get("bad_paths", ())),
                    False)


def _generate(root: Path, spec: DemoDataSpec, progress: bool) -> tuple[str, ...]:
    """Write the train and val splits under ``root`` and its ``spec.json`` last."""
    from raying.engine.progress import progress_bar

    train, val = root / "train", root / "val"
    rng = np.random.default_rng([spec.seed, 0xDA7A])
    counts = [spec.rare_per_class if c in spec.rare_classes else spec.common_per_class
              for c in range(len(CLASS_SHAPES))]
    val_counts = [spec.val_per_class] * len(CLASS_SHAPES)
    with progress_bar(total=sum(counts) + sum(val_counts), desc="generating demo data",
                      unit="img", enabled=progress) as bar:
        _write_split(train, counts, spec, rng, bar)
        _write_split(val, val_counts, spec, np.random.default_rng([spec.seed, 0x7A1]), bar)
    bad = _write_bad_files(train) if spec.bad_files else ()
    info: dict[str, Any] = {**dataclasses.asdict(spec), "bad_paths": list(bad),
                            "classes": list(CLASS_SHAPES), "train_counts": counts}
    (root / "spec.json").write_text(json.dumps(info, indent=2))
    return bad

