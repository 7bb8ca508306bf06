"""One save-and-resume check for every stateful piece (in the spirit of torchdata's helper)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def assert_same(expected: Any, got: Any, where: str = "state") -> None:
    """Assert two nested structures of dicts, sequences, arrays and scalars are identical."""
    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping), f"{where}: expected a mapping, got {type(got).__name__}"
        assert set(expected) == set(got), f"{where}: keys {sorted(expected)} != {sorted(got)}"
        for key in expected:
            assert_same(expected[key], got[key], f"{where}[{key!r}]")
    elif isinstance(expected, np.ndarray) or isinstance(got, np.ndarray):
        e, g = np.asarray(expected), np.asarray(got)
        assert e.shape == g.shape, f"{where}: shape {e.shape} != {g.shape}"
        assert e.dtype == g.dtype, f"{where}: dtype {e.dtype} != {g.dtype}"
        assert np.array_equal(e, g, equal_nan=e.dtype.kind == "f"), f"{where}: arrays differ"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(expected) == len(got), \
            f"{where}: expected a sequence of {len(expected)}, got {got!r}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_same(e, g, f"{where}[{i}]")
    else:
        assert expected == got, f"{where}: {expected!r} != {got!r}"


def run_state_roundtrip(make: Callable[[], Any], advance: Callable[[Any], None],
                        observe: Callable[[Any], Any], *,
                        through: Callable[[dict], dict] | None = None) -> None:
    """Check that an object resumed from its ``state_dict`` continues exactly like the original.

    1. ``a = make()``; ``advance(a)``; save ``a.state_dict()`` (deep-copied, so later changes
       to ``a`` cannot leak into it), then ``observe(a)``: the continuation.
    2. ``b = make()``; ``b.load_state_dict(state)``; ``observe(b)`` must be identical.
    3. ``b`` saved again right after loading gives the same state as ``a`` did.
    4. A fresh object, never advanced, observes something else (else the check is empty).

    Args:
        make: builds a fresh object with the same settings.
        advance: moves an object forward (updates, draws, ...).
        observe: advances further and returns what it saw (draws, probabilities, counters).
        through: optional encode-then-decode of the state (e.g. a snapshot file format).
    """
    a = make()
    advance(a)
    original = copy.deepcopy(a.state_dict())
    state = copy.deepcopy(original) if through is None else through(copy.deepcopy(original))
    expected = observe(a)

    b = make()
    b.load_state_dict(state)
    resaved = copy.deepcopy(b.state_dict())
    got = observe(b)
    assert_same(expected, got, "continuation")
    assert_same(original, resaved, "state after load")

    # A fresh object that is only advanced (never saved) must differ from a fresh one, or the
    # check above proves nothing: observe must actually depend on the state.
    c = make()
    fresh = observe(c)
    try:
        assert_same(expected, fresh, "fresh")
    except AssertionError:
        return
    msg = "observe() gives the same result with and without advance(); it checks nothing"
    raise AssertionError(msg)
