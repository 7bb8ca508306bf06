"""Decoded arrays as cache payloads: a small self-describing header, then the raw pixels."""

from __future__ import annotations

import json
import struct

import numpy as np

from raying.errors import DataError

_ARRAY_MAGIC = b"RYA1"
_ARRAY_HEAD = struct.Struct("<4sI")


def encode_array(arr: np.ndarray) -> np.ndarray:
    """An array as bytes (a flat uint8 array): magic, header length, JSON (dtype, shape), then
    the raw data, copied once."""
    arr = np.asarray(arr)
    payload, view = new_array_payload(arr.shape, arr.dtype)
    view[...] = arr
    return payload


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
