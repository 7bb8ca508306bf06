"""The read task's reusable output buffer: base-size pages, sized for the unit's largest block."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from raying.read import task as _task


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    entry: dict[str, str] | None = None
    found: dict[str, str] = {}
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = {} if lo <= address < hi else None
                if entry is not None:
                    found = entry
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key.strip()] = value.strip()
    return found


def test_small_pages_is_a_zeroed_writable_array():
    a = _task.small_pages((3, 5, 5, 3))
    assert a.shape == (3, 5, 5, 3) and a.dtype == np.uint8
    assert a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[...] = 7
    assert int(a.sum()) == 7 * a.size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_small_pages_are_not_huge_page_eligible():
    # numpy advises huge pages for arrays of 4 MiB and more; this buffer must opt out.
    a = _task.small_pages((64, 224, 224, 3))
    a[...] = 1
    entry = _smaps_entry(a.ctypes.data)
    if "THPeligible" not in entry:
        pytest.skip("this kernel does not report THPeligible")
    assert entry["THPeligible"] == "0", entry
    assert "nh" in entry.get("VmFlags", "").split(), entry


def test_output_buffer_is_sized_for_the_largest_block_at_once(monkeypatch):
    monkeypatch.setattr(_task, "_out_buffer", None)
    first = _task._output(64, 8, 128)  # a short first block of a unit of 128-row blocks
    assert first.shape == (64, 8, 8, 3)
    base = _task._out_buffer
    assert base.shape[0] == 128
    second = _task._output(128, 8, 128)
    assert _task._out_buffer is base  # no new pages for the second block
    assert np.shares_memory(first, second)
    _task._output(200, 8, 128)  # a larger block than ever: grows
    assert _task._out_buffer.shape[0] == 200
