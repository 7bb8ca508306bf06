"""Extra Parquet columns carried into every batch: which types, and how each becomes numpy.

``Manifest.scan(uri, columns=[...])`` records one description per column (``kind``, ``dtype``
and, for fixed-size lists, ``width``) in the manifest's meta; read tasks turn each column's
Arrow values into one numpy array per block, and the loaders turn those into tensors:

==============================  ===========  =============================================
Parquet type                    kind         in a numpy block
==============================  ===========  =============================================
integer, floating, bool         ``number``   1-D array of ``dtype`` (int64, float32/64, bool)
string, large_string            ``string``   1-D object array of ``str``
binary, large_binary            ``bytes``    1-D object array of ``bytes``
list / large_list of numbers    ``list``     1-D object array of 1-D ``dtype`` arrays
fixed_size_list of numbers      ``array``    2-D array ``(n, width)`` of ``dtype``
==============================  ===========  =============================================

Dictionary-encoded columns count as their value type. Nulls are not carried: a null in an
extra column stops the read with an error naming the file and the column.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from raying.errors import DataError

# The keys every block has; an extra column may not take one of these names.
RESERVED = ("id", "label", "image", "weight", "prob")


def describe(t: pa.DataType) -> dict[str, Any] | None:
    """The description of a column of type ``t`` (see the module docstring), or None when
    raying cannot carry that type."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return {"kind": "string"}
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return {"kind": "bytes"}
    dtype = _number_dtype(t)
    if dtype is not None:
        return {"kind": "number", "dtype": dtype}
    if pa.types.is_fixed_size_list(t):
        dtype = _number_dtype(t.value_type)
        if dtype is not None:
            return {"kind": "array", "dtype": dtype, "width": int(t.list_size)}
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        dtype = _number_dtype(t.value_type)
        if dtype is not None:
            return {"kind": "list", "dtype": dtype}
    return None


def _number_dtype(t: pa.DataType) -> str | None:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int64"
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return "float32"
    if pa.types.is_float64(t):
        return "float64"
    return None


def to_numpy(values: pa.Array | pa.ChunkedArray, desc: dict[str, Any], *, name: str,
             where: str) -> np.ndarray:
    """One column's values as the numpy array its description promises.

    Raises:
        DataError: the column holds nulls (``where`` and ``name`` say which file and column).
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if values.null_count:
        msg = (f"{where}: extra column {name!r} has {values.null_count} null values; raying "
               f"carries no nulls in extra columns: fill them (e.g. '' or -1) in the data, or "
               f"scan without columns=[{name!r}]")
        raise DataError(msg)
    kind = desc["kind"]
    n = len(values)
    if kind == "number":
        return values.to_numpy(zero_copy_only=False).astype(desc["dtype"], copy=False)
    if kind in ("string", "bytes"):
        out = np.empty(n, dtype=object)
        out[:] = values.to_pylist()
        return out
    flat = values.values.to_numpy(zero_copy_only=False).astype(desc["dtype"], copy=False)
    if kind == "array":
        width = int(desc["width"])
        start = values.offset * width
        return flat[start:start + n * width].reshape(n, width)
    offsets = values.offsets.to_numpy()
    out = np.empty(n, dtype=object)
    for i in range(n):
        out[i] = flat[offsets[i]:offsets[i + 1]]
    return out


def empty(desc: dict[str, Any]) -> np.ndarray:
    """A column of no rows, with the dtype and shape its description promises."""
    if desc["kind"] == "number":
        return np.zeros(0, dtype=desc["dtype"])
    if desc["kind"] == "array":
        return np.zeros((0, int(desc["width"])), dtype=desc["dtype"])
    return np.empty(0, dtype=object)
