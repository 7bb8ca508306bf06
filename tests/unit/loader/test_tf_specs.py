"""The tf types to_tf gives the columns of a numpy batch, and what it refuses by name."""

from __future__ import annotations

import numpy as np
import pytest

from raying.errors import ConfigError

tf = pytest.importorskip("tensorflow")


def test_columns_get_tf_types_and_object_columns_of_numbers_are_refused_with_the_fix():
    from raying.loader.tf import _batch_spec

    assert _batch_spec(tf, "s", np.array(["a", "bb"]), None)[0].dtype == tf.string
    ragged, rows = _batch_spec(tf, "r", np.array([np.zeros(2, np.float32), np.zeros(3, np.float32)],
                                                 dtype=object), None)
    assert isinstance(ragged, tf.RaggedTensorSpec) and rows == np.float32
    assert _batch_spec(tf, "x", np.zeros((4, 3), np.int16), None)[0].shape.as_list() == [None, 3]
    numbers = np.empty(2, dtype=object)
    numbers[:] = [np.float32(1.0), np.float32(2.0)]
    with pytest.raises(ConfigError, match=r"'n' is an object array of float32 numbers.*"
                                          r"np.asarray\(list\(values\)\)"):
        _batch_spec(tf, "n", numbers, None)
    with pytest.raises(ConfigError, match=r"'d' holds dict rows, which tf.data has no type"):
        _batch_spec(tf, "d", np.array([{}, {}], dtype=object), None)


def test_rows_of_arrays_take_the_common_dtype_of_the_first_batch_s_rows():
    """A per-row column whose first row is int64 and a later one float64 is typed float64
    (typed by its first row, every float row became an int)."""
    from raying.loader.tf import _batch_spec

    rows = np.empty(3, dtype=object)
    rows[:] = [np.array([1, 2]), np.array([0.25, 0.5]), np.array([3], np.int32)]
    spec, dtype = _batch_spec(tf, "boxes", rows, None)
    assert dtype == np.float64 and spec.dtype == tf.float64
    rows[:] = [np.array([]), np.array([1, 2]), np.array([3])]  # an empty row: "no boxes"
    assert _batch_spec(tf, "cls", rows, None)[1] == np.int64
