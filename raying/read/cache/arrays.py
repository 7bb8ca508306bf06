"""Decoded arrays as cache payloads: a small self-describing header, then the raw pixels."""

from __future__ import annotations

import json
import struct

import numpy as np

from raying.errors import DataError

_ARRAY_MAGIC = b"RYA1"
_ARRAY_HEAD = struct.Struct("<4sI")


def encode_array(arr: np.ndarray) -> bytearray:
    """An array as bytes: magic, header length, JSON (dtype, shape), then the raw data."""
    arr = np.asarray(arr)
    head = json.dumps({"dtype": arr.dtype.str, "shape": list(arr.shape)}).encode()
    lead = _ARRAY_HEAD.pack(_ARRAY_MAGIC, len(head)) + head
    out = bytearray(len(lead) + arr.nbytes)  # one copy of the pixels, not three
    out[:len(lead)] = lead
    np.frombuffer(out, dtype=arr.dtype, offset=len(lead)).reshape(arr.shape)[...] = arr
    return out


def decode_array(data: bytes | memoryview) -> np.ndarray:
    """The array of :func:`encode_array` (a read-only view of ``data``)."""
    view = memoryview(data)
    magic, n = _ARRAY_HEAD.unpack_from(view)
    if magic != _ARRAY_MAGIC:
        msg = "cached array has a bad header; clear the cache directory"
        raise DataError(msg)
    meta = json.loads(bytes(view[_ARRAY_HEAD.size:_ARRAY_HEAD.size + n]))
    body = view[_ARRAY_HEAD.size + n:]
    return np.frombuffer(body, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])
