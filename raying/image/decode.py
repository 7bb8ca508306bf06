"""Decode encoded images to HxWx3 uint8 RGB: libjpeg-turbo for JPEG, PIL for the rest.

Every failure is a :class:`raying.errors.DecodeError` whose ``reason`` is one of
:data:`DECODE_ERROR_REASONS`:

- ``"empty"``: zero bytes.
- ``"missing"``: no data at all (``None``; a null cell of a Parquet column).
- ``"truncated"``: a known image format whose data ends early. Never decoded into a
  half-grey image: simplejpeg runs with ``strict=True`` and PIL with its default
  ``ImageFile.LOAD_TRUNCATED_IMAGES = False`` (raying does not change PIL's globals).
- ``"not_an_image"``: no image signature and no decoder recognises the bytes (text, noise).
- ``"too_large"``: the header claims more than ``max_pixels`` pixels (decompression bombs);
  checked before any pixel is decoded.
- ``"unsupported"``: a real image raying cannot decode: HEIF/AVIF/JPEG XL without their PIL
  plug-in, a mode or compression PIL lacks, or input that is not bytes.
- ``"corrupt"``: a recognised format whose data is broken in some other way.

Conversions to RGB: grayscale is repeated to three channels; alpha is dropped (as
torchvision's ``ImageReadMode.RGB``), palette images with transparency included; 16-bit
samples become 8-bit by ``>> 8`` (PIL's ``"I;16"`` and ``"I"`` modes; ``"F"`` is clipped to
0-255); CMYK/YCCK JPEGs, which libjpeg-turbo cannot turn into RGB, go to PIL. EXIF
orientation is applied on both paths.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import cv2
import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from raying.errors import ConfigError, DecodeError
from raying.image import exif as _exif
from raying.options import DEFAULT_MAX_IMAGE_PIXELS, settings

try:  # the C extension (setup.py), built when libjpeg's headers were there at install
    from raying.image._jpegroi import decode_region as _decode_region
except ImportError:  # pragma: no cover - a build without libjpeg-dev
    _decode_region = None

# Whether JPEGs can decode only the region a crop needs (see decode_jpeg_region).
ROI_DECODE = _decode_region is not None

__all__ = ["DECODE_ERROR_REASONS", "decode_image", "image_size"]

DECODE_ERROR_REASONS = ("empty", "missing", "truncated", "not_an_image", "too_large",
                        "unsupported", "corrupt")

# libjpeg-turbo decodes at n/8 of the full size for n in 1..16, but only 1/8, 1/4 and 1/2 run
# its SIMD paths: measured here (500x375, q90), 3/8, 5/8, 6/8 and 7/8 took 0.8-1.8 ms against
# 0.9 ms for the full size and 0.5-0.7 ms for 1/8-1/2.
JPEG_FAST_SCALE_EIGHTHS = (1, 2, 4, 8)
_JPEG_FAST_COLORSPACES = ("YCbCr", "Gray", "RGB")

_SIGNATURES = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG2000"),
    (b"\xff\x4f\xff\x51", "JPEG2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEGXL"),
    (b"\xff\x0a", "JPEGXL"),
)
# ISO-BMFF brands (bytes 8-12 after "ftyp") of HEIF/AVIF files.
_FTYP_BRANDS = {b"heic": "HEIF", b"heix": "HEIF", b"hevc": "HEIF", b"heim": "HEIF",
                b"heis": "HEIF", b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF",
                b"avis": "AVIF"}
# Real image formats that PIL reads only with a plug-in raying does not install.
_PLUGIN_FORMATS = {"HEIF": "pillow-heif", "JPEGXL": "pillow-jxl-plugin",
                   "AVIF": "pillow-avif-plugin"}
_TRUNCATION_WORDS = ("truncat", "premature end of jpeg file", "end of file", "eof",
                     "not enough data", "unexpected end")
_UNSUPPORTED_WORDS = ("not available", "unsupported", "not supported", "unknown raw mode")


def as_buffer(data) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or a 1-D uint8 numpy array."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            msg = (f"encoded image arrays must be 1-D uint8, got {data.dtype} with shape "
                   f"{data.shape}; pass the file's bytes")
            raise DecodeError("unsupported", msg)
        data = np.ascontiguousarray(data)
    try:
        return memoryview(data).cast("B")
    except TypeError:
        msg = f"expected bytes, memoryview or a uint8 array, got {type(data).__name__}"
        raise DecodeError("unsupported", msg) from None


def sniff_format(buf: memoryview) -> str | None:
    """The image format named by the leading bytes, or None when no signature matches."""
    head = bytes(buf[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp" and head[8:12] in _FTYP_BRANDS:
        return _FTYP_BRANDS[head[8:12]]
    for magic, name in _SIGNATURES:
        if head.startswith(magic):
            return name
    return None


def check_pixels(height: int, width: int, max_pixels: int | None) -> None:
    """Raise ``too_large`` when ``height * width`` is above ``max_pixels`` (None: no limit)."""
    if max_pixels is not None and height * width > max_pixels:
        detail = (f"{height}x{width} = {height * width} pixels is over the limit of "
                  f"{max_pixels} (a decompression bomb?); raise it with "
                  "PipelineConfig(max_image_pixels=...), the environment variable "
                  "RAYING_MAX_IMAGE_PIXELS or decode_image's max_pixels argument")
        raise DecodeError("too_large", detail)


def check_max_pixels(max_pixels) -> None:
    """Refuse a ``max_pixels`` argument that is not a positive integer or None."""
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(
            max_pixels, (int, np.integer)) or max_pixels <= 0):
        msg = f"max_pixels must be a positive integer or None, got {max_pixels!r}"
        raise ConfigError(msg)


def start_buffer(data) -> memoryview:
    """The bytes of one sample as a memoryview; ``missing`` for None, ``empty`` for b""."""
    if data is None:
        raise DecodeError("missing", "no image data (None)")
    buf = as_buffer(data)
    if buf.nbytes == 0:
        raise DecodeError("empty", "zero bytes")
    return buf


# --- JPEG fast path (libjpeg-turbo via simplejpeg) ----------------------------------------------


def jpeg_header(buf: memoryview, max_pixels: int | None) -> tuple[int, int, int] | None:
    """``(stored height, stored width, EXIF orientation)`` of a JPEG the fast path takes.

    None when the data is not a JPEG, or is one libjpeg-turbo cannot turn into RGB (CMYK,
    YCCK, 12-bit, lossless): PIL decodes those. Raises ``too_large`` from the header alone.
    """
    if bytes(buf[:3]) != b"\xff\xd8\xff":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(buf)
    except ValueError:
        return None
    if colorspace not in _JPEG_FAST_COLORSPACES:
        return None
    check_pixels(height, width, max_pixels)
    return height, width, _exif.jpeg_orientation(buf)


def jpeg_scale_eighths(height: int, width: int, min_height: int, min_width: int) -> int:
    """Smallest fast DCT scale n (decode at n/8) keeping at least min_height x min_width.

    Minimums <= 0 are ignored, as simplejpeg does; with neither set the scale is 8 (full).
    """
    if min_height <= 0 and min_width <= 0:
        return 8
    for n in JPEG_FAST_SCALE_EIGHTHS:
        if -(-height * n // 8) >= min_height and -(-width * n // 8) >= min_width:
            return n
    return 8


def decode_jpeg_stored(buf: memoryview, height: int, width: int, eighths: int = 8,
                       out: np.ndarray | None = None) -> np.ndarray:
    """Decode a JPEG at ``eighths``/8 of its stored size, before orientation (into ``out``,
    a writable uint8 array of that size and 3 channels, when given).

    Strict: data that ends early raises ``truncated`` (libjpeg would pad it with grey), and
    libjpeg's "Corrupt JPEG data" warnings raise ``corrupt``, except extraneous bytes between
    segments, a harmless and common defect that libjpeg skips exactly.
    """
    scaled_h = -(-height * eighths // 8)
    scaled_w = -(-width * eighths // 8)
    try:
        return simplejpeg.decode_jpeg(buf, "RGB", min_height=scaled_h, min_width=scaled_w,
                                      buffer=out, strict=True)
    except ValueError as exc:
        text = str(exc)
        if _is_truncation(exc):
            raise DecodeError("truncated", f"JPEG data ends early ({text})") from None
        if "extraneous bytes" not in text:
            raise DecodeError("corrupt", f"JPEG: {text}") from None
    try:
        return simplejpeg.decode_jpeg(buf, "RGB", min_height=scaled_h, min_width=scaled_w,
                                      buffer=out, strict=False)
    except ValueError as exc:
        raise DecodeError("corrupt", f"JPEG: {exc}") from None


def decode_jpeg_region(buf: memoryview, eighths: int, top: int, left: int, height: int,
                       width: int, out: np.ndarray) -> bool:
    """Decode rows ``[top, top + height)`` and columns ``[left, left + width)`` of a JPEG
    at ``eighths``/8 of its stored size (before orientation) into ``out``, a C-contiguous
    ``(height, width, 3)`` uint8 array; True when done.

    libjpeg entropy-decodes the rows above the region without their IDCT and colour
    conversion, never reads the rows below it, and runs the IDCT only on the columns that
    cover it, with 16 pixels of context around it so the pixels equal the whole decode's.
    False (nothing decoded) when the extension is not built or ``RAYING_ROI_DECODE=0``,
    when the data is not a sound stream to its end (a missing end marker, a stray marker:
    the region decode would not read that far, so a truncated or corrupt file goes to the
    whole, strict decode, which names it), and when libjpeg refuses or warns within the
    region (the whole decode then raises the error the caller reports). Bit errors that
    libjpeg would only notice below the region are not seen.
    """
    if _decode_region is None or not settings().roi_decode:
        return False
    try:
        return bool(_decode_region(buf, eighths, top, left, height, width, out))
    except ValueError:
        return False


def region_scratch_bytes(height: int, width: int) -> int:
    """Bytes of the ``scratch`` that :func:`decode_jpeg_region_view` needs for a region: 16
    rows of context above it, 16 columns each side and libjpeg's alignment to whole iMCUs
    (up to 32 pixels more)."""
    return (height + 16) * (width + 96) * 3


def decode_jpeg_region_view(buf: memoryview, eighths: int, top: int, left: int, height: int,
                            width: int, scratch: np.ndarray) -> np.ndarray | None:
    """:func:`decode_jpeg_region` without its copy: libjpeg writes its rows (the region, some
    context above it and iMCU-aligned columns around it) straight into ``scratch`` (1-D uint8,
    at least ``region_scratch_bytes(height, width)`` bytes), several rows per call, and the
    region comes back as a ``(height, width, 3)`` view of it with a row stride of its own.
    None where decode_jpeg_region returns False. About 7 % faster than the copying decode on
    ImageNet-like JPEGs (11 % on progressive ones)."""
    if _decode_region is None or not settings().roi_decode:
        return None
    try:
        got = _decode_region(buf, eighths, top, left, height, width, scratch, True)
    except ValueError:
        return None
    if got is False:
        return None
    r, c, stride = got
    rows = scratch[:(r + height) * stride * 3].reshape(r + height, stride, 3)
    return rows[r:, c:c + width]


def _is_truncation(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(word in text for word in _TRUNCATION_WORDS)


def _ends_early(buf: memoryview, fmt: str | None) -> bool:
    """Whether a PNG's chunks or a JPEG's header segments run past the end of the data."""
    n = len(buf)
    if fmt == "PNG":
        pos = 8
        while pos + 8 <= n:
            length = int.from_bytes(buf[pos:pos + 4], "big")
            if bytes(buf[pos + 4:pos + 8]) == b"IEND":
                return False
            pos += 12 + length
        return True
    if fmt == "JPEG":
        pos = 2
        while pos + 4 <= n:
            marker = buf[pos + 1]
            if buf[pos] != 0xFF or marker == 0xDA:  # entropy data: the decoder's business
                return False
            if marker == 0xFF or marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
                pos += 1 if marker == 0xFF else 2
                continue
            pos += 2 + ((buf[pos + 2] << 8) | buf[pos + 3])
        return True
    return False


def _failure(buf: memoryview, fmt: str | None, exc: BaseException) -> DecodeError:
    """Classify a PIL failure on data whose signature says ``fmt``."""
    if isinstance(exc, UnidentifiedImageError):  # its message holds an object's address
        exc = UnidentifiedImageError("PIL cannot identify the data")
    if fmt is None:
        return DecodeError("not_an_image", f"no known image signature ({exc})")
    if fmt in _PLUGIN_FORMATS and isinstance(exc, UnidentifiedImageError):
        detail = (f"{fmt} needs a PIL plug-in (pip install {_PLUGIN_FORMATS[fmt]}, then "
                  "register it in the workers) or conversion to JPEG/PNG")
        return DecodeError("unsupported", detail)
    if _is_truncation(exc) or _ends_early(buf, fmt):
        return DecodeError("truncated", f"{fmt} data ends early ({exc})")
    if any(word in str(exc).lower() for word in _UNSUPPORTED_WORDS):
        return DecodeError("unsupported", f"{fmt}: {exc}")
    return DecodeError("corrupt", f"{fmt}: {exc}")


# --- PIL path -----------------------------------------------------------------------------------


def pil_open(buf: memoryview, max_pixels: int | None) -> Image.Image:
    """Open lazily (header only) and check the pixel count before any decoding.

    This is ``Image.open`` minus its check against PIL's process-wide ``MAX_IMAGE_PIXELS``
    (which would warn, or refuse a limit the caller raised): raying checks ``max_pixels``
    itself and leaves PIL's globals alone.
    """
    fp = io.BytesIO(buf)
    Image.preinit()
    prefix = fp.read(16)
    for loader in (None, Image.init):
        if loader is not None:
            loader()
        for fmt in list(Image.ID):
            factory, accept = Image.OPEN[fmt]
            fp.seek(0)
            try:
                accepted = accept(prefix) if accept else True
                if not accepted or isinstance(accepted, str):
                    continue
                im = factory(fp, "")
            except (SyntaxError, IndexError, TypeError, struct.error):
                continue
            width, height = im.size
            check_pixels(height, width, max_pixels)
            return im
    msg = "cannot identify image file"
    raise UnidentifiedImageError(msg)


def _pil_orientation(im: Image.Image, *, allow_load: bool) -> int:
    if not allow_load and im.format == "PNG" and "exif" not in im.info:
        return 1  # PNG's getexif() would decode the pixels to find a trailing eXIf chunk
    try:
        value = im.getexif().get(_exif.ORIENTATION_TAG, 1)
    except (OSError, SyntaxError, ValueError, struct.error):
        return 1
    return value if value in _exif.ORIENTATION_OPS else 1


def _gray(arr: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(np.ascontiguousarray(arr), cv2.COLOR_GRAY2RGB)


def pil_to_rgb(im: Image.Image) -> np.ndarray:
    """Pixels of a loaded PIL image as a C-contiguous HxWx3 uint8 RGB array."""
    mode = im.mode
    if mode == "RGB":
        return np.array(im)
    if mode == "L":
        return _gray(np.asarray(im))
    if mode in ("RGBA", "RGBa", "RGBX"):
        return cv2.cvtColor(np.asarray(im), cv2.COLOR_RGBA2RGB)
    if mode in ("LA", "La"):
        return _gray(np.asarray(im)[..., 0])
    if mode.startswith("I;16") or mode == "I":
        wide = np.asarray(im).astype(np.int64, copy=False)
        return _gray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8))
    if mode == "F":
        return _gray(np.clip(np.asarray(im), 0, 255).astype(np.uint8))
    if mode in ("P", "PA") and (mode == "PA" or "transparency" in im.info):
        return cv2.cvtColor(np.asarray(im.convert("RGBA")), cv2.COLOR_RGBA2RGB)
    if mode == "1":
        return _gray(np.asarray(im.convert("L")))
    try:
        return np.array(im.convert("RGB"))
    except (ValueError, OSError) as exc:
        raise DecodeError("unsupported", f"cannot convert PIL mode {mode!r} to RGB: {exc}") \
            from None


def decode_pil(buf: memoryview, max_pixels: int | None) -> np.ndarray:
    """Decode with PIL (any format it knows), upright; classify every failure into a reason."""
    fmt = sniff_format(buf)
    try:
        im = pil_open(buf, max_pixels)
        im.load()
        arr = pil_to_rgb(im)
        orientation = _pil_orientation(im, allow_load=True)
    except DecodeError:
        raise
    except Image.DecompressionBombError as exc:  # from a plug-in's own check (GIF frames)
        raise DecodeError("too_large", f"{exc}; raise PIL.Image.MAX_IMAGE_PIXELS") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError,
            struct.error, zlib.error, MemoryError) as exc:
        raise _failure(buf, fmt, exc) from None
    return _exif.apply_orientation(arr, orientation)


# --- public -------------------------------------------------------------------------------------


def decode_image(data, *, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                 min_height: int = 0, min_width: int = 0) -> np.ndarray:
    """Decode one encoded image to an upright HxWx3 uint8 RGB array (C-contiguous).

    JPEGs go through libjpeg-turbo; when ``min_height``/``min_width`` allow, they decode in
    the DCT domain at 1/2, 1/4 or 1/8 of the size (never below those minimums, which refer
    to the upright image). Other formats decode with PIL at full size.

    Args:
        data: the encoded file: bytes, bytearray, memoryview or a 1-D uint8 array.
        max_pixels: refuse images whose header claims more pixels (None: no limit). The
            default comes from ``RAYING_MAX_IMAGE_PIXELS``.
        min_height: smallest acceptable output height for a DCT-scaled JPEG decode.
        min_width: smallest acceptable output width for a DCT-scaled JPEG decode.

    Returns:
        The image, shape (H, W, 3), dtype uint8, EXIF orientation applied.

    Raises:
        DecodeError: with ``reason`` in :data:`DECODE_ERROR_REASONS`.
    """
    check_max_pixels(max_pixels)
    buf = start_buffer(data)
    header = jpeg_header(buf, max_pixels)
    if header is None:
        return decode_pil(buf, max_pixels)
    height, width, orientation = header
    if _exif.swaps_axes(orientation):
        min_height, min_width = min_width, min_height
    eighths = jpeg_scale_eighths(height, width, min_height, min_width)
    arr = decode_jpeg_stored(buf, height, width, eighths)
    return _exif.apply_orientation(arr, orientation)


def decode_image_to(data, alloc: Callable[[tuple[int, int, int]], np.ndarray], *,
                    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[np.ndarray, bool]:
    """:func:`decode_image` at full size, decoded straight into ``alloc((h, w, 3))`` where
    the decoder can write the final pixels there (an upright JPEG libjpeg-turbo decodes).

    Returns ``(image, placed)``: ``placed`` says the image is the array ``alloc`` returned;
    otherwise (other formats, EXIF-turned JPEGs) it is a fresh array and ``alloc`` was not
    called. Raises what :func:`decode_image` raises.
    """
    check_max_pixels(max_pixels)
    buf = start_buffer(data)
    header = jpeg_header(buf, max_pixels)
    if header is None or header[2] != 1:
        return decode_image(buf, max_pixels=max_pixels), False
    height, width, _ = header
    dst = alloc((height, width, 3))
    return decode_jpeg_stored(buf, height, width, 8, out=dst), True


def image_size(data) -> tuple[int, int]:
    """``(height, width)`` of the upright image, read from the header without decoding.

    For PNG, an EXIF orientation stored after the pixel data is not seen here.

    Raises:
        DecodeError: when the header cannot be read (same reasons as :func:`decode_image`).
    """
    buf = start_buffer(data)
    header = jpeg_header(buf, None)
    if header is not None:
        height, width, orientation = header
    else:
        fmt = sniff_format(buf)
        try:
            im = pil_open(buf, None)
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error) as exc:
            raise _failure(buf, fmt, exc) from None
        width, height = im.size
        orientation = _pil_orientation(im, allow_load=False)
        stored = getattr(im, "_tile_size", None)  # a TIFF's size as stored, where Pillow's
        if (im.format == "TIFF" and stored is not None and _exif.swaps_axes(orientation)
                and tuple(stored) == (height, width)):  # plugin already reports it upright
            return height, width
    if _exif.swaps_axes(orientation):
        return width, height
    return height, width
