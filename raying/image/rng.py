"""Counter-based random numbers: uniforms from a hash of (seed, epoch, sample id, draw index)."""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_GOLDEN_U64 = np.uint64(_GOLDEN)
_MUL1_U64 = np.uint64(_MUL1)
_MUL2_U64 = np.uint64(_MUL2)
_TWO_POW_M53 = 2.0**-53


def _mix_int(z: int) -> int:
    """splitmix64's finalizer on a Python int (scalar keys: seed, epoch)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array (wrapping arithmetic)."""
    z ^= z >> np.uint64(30)
    z *= _MUL1_U64
    z ^= z >> np.uint64(27)
    z *= _MUL2_U64
    z ^= z >> np.uint64(31)
    return z


def epoch_key(seed: int, epoch: int, stream: int = 0) -> int:
    """The 64-bit key of one (seed, epoch, stream); every draw of that epoch derives from it."""
    key = _mix_int(int(seed) * _GOLDEN + int(stream) + 1)
    return _mix_int(key + (int(epoch) + 1) * _GOLDEN)


def uniforms(seed: int, epoch: int, ids: np.ndarray, n_draws: int,
             stream: int = 0) -> np.ndarray:
    """Uniform floats in [0, 1), shape ``(len(ids), n_draws)``.

    Draw ``k`` of sample ``id`` is ``hash(seed, epoch, id, k)``: it does not depend on which
    other ids share the call, their order, or which process computes it, so an epoch is
    reproducible however its ids are grouped into blocks, retried or spread over workers.

    Args:
        seed: any integer.
        epoch: the epoch number.
        ids: integer sample ids (any shape is flattened).
        n_draws: how many independent uniforms each id gets.
        stream: separates independent uses of the same (seed, epoch).
    """
    key = np.uint64(epoch_key(seed, epoch, stream))
    ids64 = np.asarray(ids, dtype=np.int64).reshape(-1).view(np.uint64)
    per_id = (ids64 + np.uint64(1)) * _GOLDEN_U64
    per_id += key
    _mix_array(per_id)
    draws = (np.arange(1, n_draws + 1, dtype=np.uint64) * _GOLDEN_U64)[None, :]
    z = per_id[:, None] + draws
    _mix_array(z)
    z >>= np.uint64(11)
    return z.astype(np.float64) * _TWO_POW_M53


def draw_keys(ids: np.ndarray, occurrence: np.ndarray | None) -> np.ndarray:
    """The keys a sample's random draws are made from: its id, or for a draw of an id that
    is not its first in the epoch (samplers that draw with replacement), the id mixed with
    which draw it is, so that each draw of one image gets a crop and flip of its own.
    ``occurrence`` (aligned with ``ids``): 0 for an id's first draw, distinct values for its
    others; None for none."""
    ids = np.asarray(ids, dtype=np.int64)
    if occurrence is None:
        return ids
    occ = np.asarray(occurrence, dtype=np.int64)
    if not occ.any():
        return ids
    salt = occ.astype(np.uint64) * _GOLDEN_U64
    _mix_array(salt)
    keys = ids.view(np.uint64) ^ np.where(occ != 0, salt, np.uint64(0))
    return keys.view(np.int64)
