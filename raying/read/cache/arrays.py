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


def new_array_payload(shape: tuple[int, ...], dtype: np.dtype | str = np.uint8
                      ) -> tuple[np.ndarray, np.ndarray]:
    """An :func:`encode_array` payload whose pixels are still to be written, and the array
    view of them: a decoder that writes into the view leaves the payload ready, without the
    copy (and the zeroed pages) of encoding a decoded array."""
    dtype = np.dtype(dtype)
    head = json.dumps({"dtype": dtype.str, "shape": list(shape)}).encode()
    lead = _ARRAY_HEAD.pack(_ARRAY_MAGIC, len(head)) + head
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    payload = np.empty(len(lead) + nbytes, dtype=np.uint8)  # pages touched by the writer
    payload[:len(lead)] = np.frombuffer(lead, dtype=np.uint8)
    view = payload[len(lead):].view(dtype).reshape(shape)
    return payload, view


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
