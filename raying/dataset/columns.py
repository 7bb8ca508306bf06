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
extra column stops the scan (numbers, strings and bytes, whose nulls the files' footers
count) or else the read, with an error naming the file and the column.
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


def arrow_type(desc: dict[str, Any]) -> pa.DataType:
    """The one Arrow type a column of description ``desc`` is carried as (files may store it
    as several: int32 and int64, string and large_string, a dictionary of either)."""
    kind = desc["kind"]
    if kind == "string":
        return pa.string()
    if kind == "bytes":
        return pa.binary()
    value = pa.from_numpy_dtype(np.dtype(desc["dtype"]))
    if kind == "number":
        return value
    if kind == "array":
        return pa.list_(value, int(desc["width"]))
    return pa.list_(value)


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
    kind = desc["kind"]
    n = len(values)
    nulls = values.null_count
    # A list's values (flatten: only this slice's) may hold nulls of their own.
    items = values.flatten() if kind in ("array", "list") and not nulls else None
    if nulls or (items is not None and items.null_count):
        what = (f"{nulls} null values" if nulls else
                f"{items.null_count} null values inside its lists")  # type: ignore[union-attr]
        msg = (f"{where}: extra column {name!r} has {what}; raying carries no nulls in extra "
               f"columns: fill them (e.g. '' or -1, or NaN for floats) in the data, or scan "
               f"without columns=[{name!r}]")
        raise DataError(msg)
    if kind == "number":
        _check_range(values, desc["dtype"], name=name, where=where)
        return values.to_numpy(zero_copy_only=False).astype(desc["dtype"], copy=False)
    if kind in ("string", "bytes"):
        out = np.empty(n, dtype=object)
        out[:] = values.to_pylist()
        return out
    _check_range(items, desc["dtype"], name=name, where=where)
    flat = items.to_numpy(zero_copy_only=False).astype(desc["dtype"], copy=False)
    if not flat.flags.writeable:
        # Arrow's buffer, shared and read-only: each row's list is a view of it, and a stage
        # may change values in place as it may every other column's.
        flat = flat.copy()
    if kind == "array":
        return flat.reshape(n, int(desc["width"]))
    offsets = values.offsets.to_numpy()
    offsets = offsets - offsets[0]  # flatten() starts at this slice's first value
    out = np.empty(n, dtype=object)
    for i in range(n):
        out[i] = flat[offsets[i]:offsets[i + 1]]
    return out


def _check_range(values: Any, dtype: str, *, name: str, where: str) -> None:
    """Unsigned 64-bit integers carried as int64 must fit it (no silent wrap-around)."""
    if dtype != "int64" or not pa.types.is_uint64(values.type) or not len(values):
        return
    import pyarrow.compute as pc

    top = pc.max(values).as_py()
    if top is not None and top > np.iinfo(np.int64).max:
        msg = (f"{where}: extra column {name!r} (uint64) holds {top}, above int64's range, "
               f"which raying carries integers as; store it as int64 (or as a string) in the "
               f"data")
        raise DataError(msg)


def empty(desc: dict[str, Any]) -> np.ndarray:
    """A column of no rows, with the dtype and shape its description promises."""
    if desc["kind"] == "number":
        return np.zeros(0, dtype=desc["dtype"])
    if desc["kind"] == "array":
        return np.zeros((0, int(desc["width"])), dtype=desc["dtype"])
    return np.empty(0, dtype=object)
