"""Bad-input image corpus: a class-folder tree mixing good images with broken and odd ones."""

from __future__ import annotations

import dataclasses
import io
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, features

# Mean colour of each class's plain images (the top-left quadrant is white, see _pattern).
CLASS_COLORS = {"cat": (200, 80, 40), "dog": (40, 120, 200)}
# A limit every good image is far below and every bomb/huge one far above.
CORPUS_MAX_PIXELS = 10_000_000
BOMB_SIDE = 10_000  # 1e8 pixels: also above raying's default limit (89,478,485)
HUGE_JPEG_SIDE = 65_000
HUGE_PNG_SIDE = 100_000
JPEG_TOLERANCE = 10.0  # max abs difference of channel means through lossy JPEG
EXACT_TOLERANCE = 0.51


@dataclasses.dataclass(frozen=True)
class ImageCase:
    """One file of the corpus and what decoding it must give.

    Attributes:
        path: relative to the corpus root, with forward slashes.
        kind: what the file is, e.g. ``"truncated_jpeg"`` or ``"cmyk_jpeg"``.
        label: the class folder.
        reason: the expected ``DecodeError.reason`` for a bad file; None for a good one.
        shape: upright (height, width) of a good file.
        mean: expected mean RGB of a good file.
        top_left: expected mean RGB of its top-left quadrant (catches wrong orientation).
        tolerance: allowed absolute difference of those means.
    """

    path: str
    kind: str
    label: str
    reason: str | None = None
    shape: tuple[int, int] | None = None
    mean: tuple[float, float, float] | None = None
    top_left: tuple[float, float, float] | None = None
    tolerance: float = EXACT_TOLERANCE

    @property
    def good(self) -> bool:
        """Whether the file must decode."""
        return self.reason is None


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """What :func:`make_image_corpus` wrote.

    Attributes:
        root: the corpus folder (class subfolders inside).
        cases: every file, sorted by path.
        max_pixels: a ``max_pixels`` under which every expectation holds.
    """

    root: Path
    cases: tuple[ImageCase, ...]
    max_pixels: int = CORPUS_MAX_PIXELS

    @property
    def good(self) -> list[ImageCase]:
        """The files that must decode."""
        return [c for c in self.cases if c.good]

    @property
    def bad(self) -> list[ImageCase]:
        """The files that must fail, each with its expected reason."""
        return [c for c in self.cases if not c.good]

    def reasons(self) -> dict[str, str]:
        """Relative path -> expected reason, for the bad files."""
        return {c.path: c.reason for c in self.bad if c.reason is not None}

    def case(self, path: str) -> ImageCase:
        """The case of one relative path."""
        for c in self.cases:
            if c.path == path:
                return c
        raise KeyError(path)


def quadrant_mean(arr: np.ndarray) -> tuple[float, float, float]:
    """Mean RGB of the top-left quadrant of an (H, W, 3) image."""
    h, w = arr.shape[:2]
    q = arr[:max(1, h // 2), :max(1, w // 2)].reshape(-1, 3)
    return tuple(float(v) for v in q.mean(axis=0))


def _mean(arr: np.ndarray) -> tuple[float, float, float]:
    return tuple(float(v) for v in arr.reshape(-1, 3).mean(axis=0))


def _pattern(h: int, w: int, color, rng: np.random.Generator) -> np.ndarray:
    """Class colour with mild noise, top-left quadrant white: content tests can check both."""
    base = np.asarray(color, dtype=np.int16)
    arr = base + rng.integers(-8, 9, size=(h, w, 3), dtype=np.int16)
    arr[:max(1, h // 2), :max(1, w // 2)] = 255
    return np.clip(arr, 0, 255).astype(np.uint8)


def _encode(arr: np.ndarray, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kwargs)  # 2-D uint8: L, uint16: I;16, (H, W, 4): RGBA
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def _png_raw(width: int, height: int, bit_depth: int, color_type: int, idat: bytes) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def _bomb_png() -> bytes:
    """A real 10000x10000 1-bit PNG (1e8 pixels) of ~12 KB: all its rows are zeros."""
    row = bytes(1 + BOMB_SIDE // 8)
    comp = zlib.compressobj(9)
    chunks = [comp.compress(row * 1000) for _ in range(BOMB_SIDE // 1000)]
    return _png_raw(BOMB_SIDE, BOMB_SIDE, 1, 0, b"".join(chunks) + comp.flush())


def _huge_jpeg(small: bytes) -> bytes:
    """A tiny JPEG whose frame header claims 65000x65000 pixels."""
    data = bytearray(small)
    pos = 2
    while pos < len(data):
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in (0xC0, 0xC1, 0xC2):
            struct.pack_into(">HH", data, pos + 5, HUGE_JPEG_SIDE, HUGE_JPEG_SIDE)
            return bytes(data)
        pos += 2 + length
    raise ValueError("no SOF marker")


def _corrupt_jpeg(good: bytes) -> bytes:
    """A complete JPEG with an undefined marker planted in the middle of its entropy data."""
    sos = good.index(b"\xff\xda")
    mid = (sos + len(good)) // 2
    return good[:mid] + b"\xff\x0b" + good[mid + 2:]


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def make_image_corpus(root: Path, *, n_good: int = 24, seed: int = 0) -> CorpusSpec:
    """Write a folder tree of good, odd and bad image files; deterministic from ``seed``.

    ``root/cat/*`` and ``root/dog/*`` hold ``n_good`` plain images (JPEG in cat, PNG in dog,
    class colour with a white top-left quadrant), the odd-but-good files (PNG named .jpg,
    CMYK JPEG, 16-bit PNGs, palette PNG with transparency, EXIF-rotated JPEG and PNG,
    grayscale, 1x1, RGBA, trailing garbage, progressive, GIF, BMP, WebP) and the bad ones
    (truncated, zero-byte, random bytes, text and HTML named as images, a decompression
    bomb, huge dimensions, corrupt JPEG and PNG, an undecodable HEIF).

    Args:
        root: folder to write into (created).
        n_good: number of plain good images.
        seed: seed of every random choice.

    Returns:
        The :class:`CorpusSpec` of what was written.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    cases: list[ImageCase] = []

    def write(rel: str, data: bytes, case: ImageCase) -> None:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        cases.append(case)

    def good(rel: str, kind: str, data: bytes, upright: np.ndarray, tol: float) -> None:
        write(rel, data, ImageCase(rel, kind, rel.split("/")[0], None, upright.shape[:2],
                                   _mean(upright), quadrant_mean(upright), tol))

    def bad(rel: str, kind: str, data: bytes, reason: str) -> None:
        write(rel, data, ImageCase(rel, kind, rel.split("/")[0], reason))

    for i in range(n_good):
        label = "cat" if i % 2 == 0 else "dog"
        h, w = (int(v) * 2 for v in rng.integers(24, 81, size=2))
        arr = _pattern(h, w, CLASS_COLORS[label], rng)
        if label == "cat":
            good(f"cat/cat_{i:03d}.jpg", "jpeg", _encode(arr, "JPEG", quality=90), arr,
                 JPEG_TOLERANCE)
        else:
            good(f"dog/dog_{i:03d}.png", "png", _encode(arr, "PNG"), arr, EXACT_TOLERANCE)

    cat, dog = CLASS_COLORS["cat"], CLASS_COLORS["dog"]
    arr = _pattern(64, 48, dog, rng)
    good("dog/odd_png_named.jpg", "png_named_jpg", _encode(arr, "PNG"), arr, EXACT_TOLERANCE)
    arr = _pattern(48, 64, cat, rng)
    buf = io.BytesIO()
    Image.fromarray(arr).convert("CMYK").save(buf, "JPEG", quality=95)
    good("cat/odd_cmyk.jpg", "cmyk_jpeg", buf.getvalue(), arr, JPEG_TOLERANCE)
    gray = _pattern(40, 56, (100, 100, 100), rng)[..., 0]
    wide = gray.astype(np.uint16) * 256 + rng.integers(0, 256, gray.shape).astype(np.uint16)
    good("dog/odd_16bit_gray.png", "png16_gray", _encode(wide, "PNG"),
         np.repeat(gray[..., None], 3, axis=2), EXACT_TOLERANCE)
    arr = _pattern(36, 52, dog, rng)
    wide = arr.astype(np.uint16) * 256 + rng.integers(0, 256, arr.shape).astype(np.uint16)
    good("dog/odd_16bit_rgb.png", "png16_rgb", cv2.imencode(".png", wide[..., ::-1])[1].tobytes(),
         arr, EXACT_TOLERANCE)
    # Palette: 0 = class colour, 1 = white (top-left quadrant), 2 = black and transparent.
    index = np.zeros((40, 60), dtype=np.uint8)
    index[:20, :30] = 1
    index[32:, :] = 2
    palette = np.array([dog, (255, 255, 255), (0, 0, 0)], dtype=np.uint8)
    im = Image.fromarray(index, "P")
    im.putpalette(palette.reshape(-1).tolist())
    buf = io.BytesIO()
    im.save(buf, "PNG", transparency=2)
    good("dog/odd_palette_transparent.png", "palette_png_transparency", buf.getvalue(),
         palette[index], EXACT_TOLERANCE)
    # EXIF orientation 6 (rotate 90 degrees clockwise to display): stored 20x40, upright 40x20.
    upright = _pattern(40, 20, cat, rng)
    good("cat/odd_exif_rotated.jpg", "exif_rotated_jpeg",
         _encode(np.ascontiguousarray(np.rot90(upright, 1)), "JPEG", quality=95,
                 exif=_exif(6)), upright, JPEG_TOLERANCE)
    upright = _pattern(30, 50, dog, rng)
    good("dog/odd_exif_rotated.png", "exif_rotated_png",
         _encode(np.ascontiguousarray(np.rot90(upright, -1)), "PNG", exif=_exif(8)), upright,
         EXACT_TOLERANCE)
    gray = _pattern(48, 40, (90, 90, 90), rng)[..., 0]
    good("cat/odd_grayscale.jpg", "gray_jpeg", _encode(gray, "JPEG", quality=95),
         np.repeat(gray[..., None], 3, axis=2), JPEG_TOLERANCE)
    one = np.array([[cat]], dtype=np.uint8)
    good("cat/odd_1x1.jpg", "one_pixel_jpeg", _encode(one, "JPEG", quality=95), one,
         JPEG_TOLERANCE)
    one = np.array([[dog]], dtype=np.uint8)
    good("dog/odd_1x1.png", "one_pixel_png", _encode(one, "PNG"), one, EXACT_TOLERANCE)
    arr = _pattern(44, 36, dog, rng)
    alpha = rng.integers(0, 256, (44, 36, 1), dtype=np.uint8)
    good("dog/odd_rgba.png", "rgba_png", _encode(np.concatenate([arr, alpha], axis=2), "PNG"),
         arr, EXACT_TOLERANCE)
    arr = _pattern(48, 48, cat, rng)
    tail = b"\x00" * 8 + b"trailing garbage after EOI" + rng.bytes(64)
    good("cat/odd_trailing_garbage.jpg", "jpeg_trailing_garbage",
         _encode(arr, "JPEG", quality=90) + tail, arr, JPEG_TOLERANCE)
    arr = _pattern(56, 72, cat, rng)
    good("cat/odd_progressive.jpg", "progressive_jpeg",
         _encode(arr, "JPEG", quality=90, progressive=True), arr, JPEG_TOLERANCE)
    arr = _pattern(40, 40, cat, rng)
    jpeg = _encode(arr, "JPEG", quality=90)
    good("cat/odd_extraneous_bytes.jpg", "jpeg_extraneous_bytes",
         jpeg[:-2] + b"\x00\x11\x22" + jpeg[-2:], arr, JPEG_TOLERANCE)
    im = Image.fromarray(index, "P")
    im.putpalette(palette.reshape(-1).tolist())
    buf = io.BytesIO()
    im.save(buf, "GIF")
    good("dog/odd_palette.gif", "gif", buf.getvalue(), palette[index], EXACT_TOLERANCE)
    arr = _pattern(30, 34, dog, rng)
    good("dog/odd_bitmap.bmp", "bmp", _encode(arr, "BMP"), arr, EXACT_TOLERANCE)
    if features.check("webp"):
        arr = _pattern(32, 48, dog, rng)
        good("dog/odd_lossless.webp", "webp", _encode(arr, "WEBP", lossless=True), arr,
             EXACT_TOLERANCE)

    arr = _pattern(64, 64, cat, rng)
    jpeg = _encode(arr, "JPEG", quality=90)
    bad("cat/bad_truncated.jpg", "truncated_jpeg", jpeg[:len(jpeg) * 2 // 3], "truncated")
    png = _encode(_pattern(64, 64, dog, rng), "PNG")
    bad("dog/bad_truncated.png", "truncated_png", png[:len(png) // 2], "truncated")
    bad("cat/bad_zero_bytes.jpg", "zero_bytes", b"", "empty")
    bad("cat/bad_random_bytes.jpg", "random_bytes", b"RND!" + rng.bytes(4096), "not_an_image")
    bad("dog/bad_text.png", "text_named_png", b"this is a text file, not a PNG\n" * 8,
        "not_an_image")
    bad("cat/bad_html.jpg", "html_named_jpg",
        b"<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>\n", "not_an_image")
    bad("dog/bad_bomb.png", "decompression_bomb_png", _bomb_png(), "too_large")
    bad("cat/bad_huge_dimensions.jpg", "huge_dimensions_jpeg", _huge_jpeg(jpeg), "too_large")
    bad("dog/bad_huge_dimensions.png", "huge_dimensions_png",
        _png_raw(HUGE_PNG_SIDE, HUGE_PNG_SIDE, 8, 0, zlib.compress(bytes(1000))), "too_large")
    bad("cat/bad_corrupt.jpg", "corrupt_jpeg", _corrupt_jpeg(jpeg), "corrupt")
    broken = bytearray(png)
    broken[29] ^= 0xFF  # the IHDR checksum
    bad("dog/bad_checksum.png", "corrupt_png", bytes(broken), "corrupt")
    bad("cat/bad_heif_named.jpg", "heif_unsupported",
        b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + rng.bytes(256), "unsupported")
    return CorpusSpec(root=root, cases=tuple(sorted(cases, key=lambda c: c.path)))
