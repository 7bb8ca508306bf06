"""An array-backed float64 sum tree with vectorized batch updates and mixture descent."""

from __future__ import annotations

import numpy as np

# Descent starts with one search over the mixture CDF of the highest level with at most this
# many nodes, skipping the top levels (each costs a dozen numpy calls however small the batch).
_SHORTCUT_NODES = 4096

# A batch touching more than this share of a level's nodes recomputes the whole level with
# contiguous slices, which beats gathering scattered parents.
_DENSE_LEVEL_SHARE = 0.25


def _unique_sorted(x: np.ndarray) -> np.ndarray:
    """Drop repeats from an already sorted array (cheaper than np.unique, which sorts)."""
    if x.size < 2:
        return x
    keep = np.empty(x.size, dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


class SumTree:
    """Leaf values and all partial sums, one float64 array per level.

    Level 0 holds the leaves (padded with zeros to an even length); level ``d`` holds the sums of
    pairs of level ``d - 1`` (padded to even length, except the single root). Parents are always
    recomputed from their two children, never adjusted by deltas, so no rounding error builds up
    however many updates arrive: the root is the pairwise sum of the current leaves.

    Args:
        leaves: the initial leaf values, finite and >= 0 (the caller validates).
    """

    def __init__(self, leaves: np.ndarray) -> None:
        self.n = int(leaves.size)
        level0 = np.zeros(self.n + (self.n % 2) if self.n > 1 else 2, dtype=np.float64)
        level0[: self.n] = leaves
        self.levels = [level0]
        while self.levels[-1].size > 1:
            half = self.levels[-1].size // 2
            size = half + (half % 2) if half > 1 else 1
            self.levels.append(np.zeros(size, dtype=np.float64))
        self.rebuild()

    @property
    def leaves(self) -> np.ndarray:
        """A view of the n leaf values (do not write to it; use set or rebuild)."""
        return self.levels[0][: self.n]

    @property
    def total(self) -> float:
        """The root: the sum of all leaves."""
        return float(self.levels[-1][0])

    def rebuild(self) -> None:
        """Recompute every internal level from the leaves."""
        for d in range(1, len(self.levels)):
            child = self.levels[d - 1]
            np.add(child[0::2], child[1::2], out=self.levels[d][: child.size // 2])

    def set(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Write leaves and recompute their ancestors level by level.

        Args:
            ids: sorted, unique, in-range leaf indices (int64).
            values: the new leaf values, same length.
        """
        if ids.size == 0:
            return
        self.levels[0][ids] = values
        idx = ids
        for d in range(1, len(self.levels)):
            child = self.levels[d - 1]
            level = self.levels[d]
            idx = _unique_sorted(idx >> 1)
            if idx.size > _DENSE_LEVEL_SHARE * level.size:
                np.add(child[0::2], child[1::2], out=level[: child.size // 2])
            else:
                left = idx << 1
                level[idx] = child[left] + child[left + 1]

    def prefix(self, idx: np.ndarray) -> np.ndarray:
        """Sums of the leaves ``[0, i)`` for each ``i`` in ``idx`` (0 <= i <= n), vectorized.

        Each set bit ``d`` of ``i`` adds the node of level ``d`` just left of the path, so a
        prefix costs one gather per level.
        """
        i = np.asarray(idx, dtype=np.int64)
        out = np.zeros(i.shape, dtype=np.float64)
        for d, level in enumerate(self.levels):
            j = i >> d
            odd = (j & 1) == 1
            if odd.any():
                out[odd] += level[j[odd] - 1]
        return out

    def descend(self, u: np.ndarray, c: float, floor: SumTree | None = None) -> np.ndarray:
        """Leaf indices at positions ``u`` of the mixture mass ``leaf_i + c`` (per real leaf),
        or ``leaf_i + c * floor_i`` with a ``floor`` tree of the same size (a floor that is
        not uniform: a prior).

        The mass of a subtree is its sum plus ``c`` times the number of real leaves under it, so
        a uniform floor is sampled exactly without being stored. ``u`` is in the same units,
        within ``[0, total + c * n)``. A child of zero mass is never entered (padding, and
        zero-valued leaves when ``c == 0``), even when rounding puts ``u`` at or past a
        boundary; the last real leaf is reachable like any other. The map from ``u`` to a leaf
        is monotone, so sorted positions give sorted leaves. The top levels are crossed in one
        step: a search over the cumulative mixture masses of the nodes of one level.

        Args:
            u: positions, float64; modified in place.
            c: the floor mass per real leaf (per unit of ``floor``), >= 0.
            floor: the per-leaf floor weights, or None for 1 on every real leaf.

        Returns:
            int64 leaf indices, one per position.
        """
        if floor is not None and c > 0.0:
            return self._descend_floor(u, c, floor)
        k = u.size
        n = self.n
        start = len(self.levels) - 1
        while start > 0 and self.levels[start - 1].size <= _SHORTCUT_NODES:
            start -= 1
        cur = self._shortcut(u, c, start) if start < len(self.levels) - 1 else \
            np.zeros(k, dtype=np.int64)
        go = np.empty(k, dtype=bool)
        step = np.empty(k, dtype=np.float64)
        for d in range(start, 0, -1):
            child = self.levels[d - 1]
            cur <<= 1  # the left child of each current node
            ml = np.take(child, cur)
            if c > 0.0:
                size = 1 << (d - 1)
                ml += c * size
                np.greater_equal(u, ml, out=go)
                # Children [0, full) hold `size` real leaves each; only the path along n is
                # partial (the left child there always has real leaves, the right may not).
                full = n // size
                edge = np.flatnonzero(cur + 1 >= full)
                if edge.size:
                    lo = cur[edge] * size
                    ml[edge] = np.take(child, cur[edge]) + c * np.minimum(n - lo, size)
                    go[edge] = (u[edge] >= ml[edge]) & (n - lo - size > 0)
            else:
                np.greater_equal(u, ml, out=go)
                go &= np.take(child, cur + 1) > 0.0
            np.multiply(ml, go, out=step)
            u -= step
            cur += go
        return cur

    def _descend_floor(self, u: np.ndarray, c: float, floor: SumTree) -> np.ndarray:
        """``descend`` with a floor tree: a node's mass is its sum plus ``c`` times the floor
        tree's sum over the same leaves (padding is zero in both, so no edge case)."""
        k = u.size
        start = len(self.levels) - 1
        while start > 0 and self.levels[start - 1].size <= _SHORTCUT_NODES:
            start -= 1
        cur = self._shortcut(u, c, start, floor) if start < len(self.levels) - 1 else \
            np.zeros(k, dtype=np.int64)
        go = np.empty(k, dtype=bool)
        step = np.empty(k, dtype=np.float64)
        for d in range(start, 0, -1):
            child, fchild = self.levels[d - 1], floor.levels[d - 1]
            cur <<= 1
            ml = np.take(child, cur) + c * np.take(fchild, cur)
            np.greater_equal(u, ml, out=go)
            go &= (np.take(child, cur + 1) + c * np.take(fchild, cur + 1)) > 0.0
            np.multiply(ml, go, out=step)
            u -= step
            cur += go
        return cur

    def _shortcut(self, u: np.ndarray, c: float, level: int,
                  floor: SumTree | None = None) -> np.ndarray:
        """Nodes of ``level`` holding positions ``u``; ``u`` becomes the offset inside each."""
        size = 1 << level
        real = -(-self.n // size)  # nodes with real leaves; the rest is padding
        if floor is not None:
            mass = self.levels[level][:real] + c * floor.levels[level][:real]
        else:
            mass = self.levels[level][:real] + c * np.minimum(size,
                                                              self.n - np.arange(real) * size)
        ends = np.cumsum(mass)
        # A zero-mass node is never chosen; rounding past the end goes to the last live node.
        node = np.minimum(np.searchsorted(ends, u, side="right"), np.flatnonzero(mass > 0)[-1])
        u -= ends[node] - mass[node]
        np.maximum(u, 0.0, out=u)
        return node


class LeafMinima:
    """The least leaf and the least positive leaf, kept current in O(k) per batch of writes.

    Each minimum is held with the number of leaves equal to it; a write that removes the last of
    them makes the next ``get`` rescan all leaves (O(n)), anything else costs O(k).
    """

    def __init__(self) -> None:
        self._state: list[float] | None = None  # [low, n_low, low_positive, n_low_positive]

    def invalidate(self) -> None:
        """Forget the minima (after a bulk change); the next ``get`` rescans."""
        self._state = None

    def get(self, leaves: np.ndarray) -> tuple[float, float]:
        """``(min, least positive)`` of ``leaves`` (inf when no leaf is positive)."""
        if self._state is None:
            low = float(leaves.min())
            low_pos = float(np.min(leaves, where=leaves > 0.0, initial=np.inf))
            self._state = [low, float(np.count_nonzero(leaves == low)), low_pos,
                           float(np.count_nonzero(leaves == low_pos))]
        return self._state[0], self._state[2]

    def replace(self, old: np.ndarray, new: np.ndarray) -> None:
        """Account for leaves (distinct rows) changing from ``old`` to ``new``."""
        if self._state is None or new.size == 0:
            return
        state = self._state
        for slot, positive in ((0, False), (2, True)):
            low = state[slot]
            pool = new[new > 0.0] if positive else new
            least = float(pool.min()) if pool.size else np.inf
            if least < low:
                state[slot], state[slot + 1] = least, float(np.count_nonzero(pool == least))
            elif np.isfinite(low):
                state[slot + 1] += np.count_nonzero(pool == low) - np.count_nonzero(old == low)
                if state[slot + 1] <= 0:
                    self._state = None
                    return
