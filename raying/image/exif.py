"""EXIF orientation: a tiny JPEG APP1 parser and the eight orientation operations."""

from __future__ import annotations

import re
import struct

import cv2
import numpy as np

ORIENTATION_TAG = 0x0112
# Bytes of a JPEG scanned for APP1 before giving up (Exif must sit in the first 64 KiB segment).
_MAX_SCAN_BYTES = 1 << 20

# Orientation -> (flip rows, flip columns, transpose): the oriented image is
# transpose?(flip(stored)). Same result as PIL's ImageOps.exif_transpose.
ORIENTATION_OPS: dict[int, tuple[bool, bool, bool]] = {
    1: (False, False, False),
    2: (False, True, False),
    3: (True, True, False),
    4: (True, False, False),
    5: (False, False, True),
    6: (True, False, True),
    7: (True, True, True),
    8: (False, True, True),
}


def jpeg_orientation(buf) -> int:
    """EXIF orientation (1-8) of a JPEG from its header bytes; 1 when absent or malformed.

    Walks the marker segments up to the start of scan and reads tag 0x0112 of IFD0 in an
    ``Exif`` APP1 segment; without that tag, ``tiff:Orientation`` of an XMP APP1 segment, as
    PIL's ``getexif()`` (and so ``ImageOps.exif_transpose``) does. Never raises: a broken
    EXIF block must not fail a decodable image.
    """
    try:
        return _jpeg_orientation(memoryview(buf).cast("B"))
    except (ValueError, TypeError, IndexError, struct.error):
        return 1


_XMP_HEADER = b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def _jpeg_orientation(buf: memoryview) -> int:
    n = min(len(buf), _MAX_SCAN_BYTES)
    pos = 2
    xmp = None  # the last XMP segment's orientation (PIL keeps the last)
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            break
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no Exif after this
            break
        seglen = (buf[pos + 2] << 8) | buf[pos + 3]
        if seglen < 2:
            break
        start = pos + 4
        end = min(pos + 2 + seglen, n)
        if marker == 0xE1 and end - start >= 14 and bytes(buf[start:start + 6]) == b"Exif\0\0":
            found = _tiff_orientation(buf, start + 6, end)
            if found is not None:  # the tag, valid or not, decides (PIL: 0 or 9 turn nothing)
                return found if found in ORIENTATION_OPS else 1
        elif marker == 0xE1 and bytes(buf[start:start + len(_XMP_HEADER)]) == _XMP_HEADER:
            match = _XMP_ORIENTATION.search(bytes(buf[start + len(_XMP_HEADER):end]))
            xmp = int(match[2]) if match else xmp
        pos += 2 + seglen
    return xmp if xmp in ORIENTATION_OPS else 1


def _tiff_orientation(buf: memoryview, base: int, end: int) -> int | None:
    """Tag 0x0112 of the TIFF block at ``base``: its value (0 for a type other than SHORT or
    LONG), or None when the block has no such tag or cannot be read."""
    order = bytes(buf[base:base + 2])
    if order == b"II":
        fmt = "<"
    elif order == b"MM":
        fmt = ">"
    else:
        return None
    magic, ifd = struct.unpack_from(fmt + "HI", buf, base + 2)
    if magic != 42:
        return None
    pos = base + ifd
    if pos + 2 > end:
        return None
    (count,) = struct.unpack_from(fmt + "H", buf, pos)
    pos += 2
    for _ in range(count):
        if pos + 12 > end:
            return None
        tag, typ = struct.unpack_from(fmt + "HH", buf, pos)
        if tag == ORIENTATION_TAG:
            if typ == 3:  # SHORT
                (value,) = struct.unpack_from(fmt + "H", buf, pos + 8)
            elif typ == 4:  # LONG, seen in the wild
                (value,) = struct.unpack_from(fmt + "I", buf, pos + 8)
            else:
                return 0
            return value
        pos += 12
    return None


def swaps_axes(orientation: int) -> bool:
    """Whether the orientation exchanges height and width."""
    return ORIENTATION_OPS.get(orientation, ORIENTATION_OPS[1])[2]


_CV2_ORIENT = {
    2: lambda a: cv2.flip(a, 1),
    3: lambda a: cv2.rotate(a, cv2.ROTATE_180),
    4: lambda a: cv2.flip(a, 0),
    5: lambda a: cv2.transpose(a),
    6: lambda a: cv2.rotate(a, cv2.ROTATE_90_CLOCKWISE),
    7: lambda a: cv2.rotate(cv2.transpose(a), cv2.ROTATE_180),
    8: lambda a: cv2.rotate(a, cv2.ROTATE_90_COUNTERCLOCKWISE),
}


def apply_orientation(a: np.ndarray, orientation: int) -> np.ndarray:
    """A new C-contiguous (H, W, 3) array turned upright; ``a`` itself when orientation is 1."""
    op = _CV2_ORIENT.get(orientation)
    return a if op is None else op(a)
