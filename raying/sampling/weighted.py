"""Static weights: draws in proportion to weights given up front (per sample or per class)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.sampling.aside import SetAside
from raying.sampling.plan import EpochPlan, ReadUnit, chunk_units, set_occurrences
from raying.sampling.weights import importance_weights, to_numpy

# Mixed into the seed of every weighted plan, so it never shares a stream with other plans.
_PLAN_STREAM = 0x5A3E1


def static_probabilities(labels: np.ndarray, *, weights: Any = None,
                         class_balanced: bool = False,
                         classes: Sequence[str] | None = None) -> np.ndarray:
    """The draw probability of every sample under static weights.

    Args:
        labels: the label index of every sample.
        weights: None (all 1), one weight per sample (a sequence of ``len(labels)``), or one
            per class (a mapping from class name or label index to weight; classes left out
            weigh 1).
        class_balanced: also divide each sample's weight by its class's size, so that every
            class present gets the same total weight (with ``weights``, their product).
        classes: the class names, to resolve names in a per-class mapping.

    Returns:
        float64 probabilities summing to 1.

    Raises:
        ConfigError: on weights of the wrong length, negative or non-finite, unknown class
            names, or weights that are all zero.
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = labels.size
    if weights is None:
        w = np.ones(n)
    elif isinstance(weights, Mapping):
        names = list(classes or [])
        # Every class of the dataset, whether or not this split holds a row of it.
        per_class = np.ones(max(len(names), int(labels.max(initial=-1)) + 1 if n else 0))
        named: dict[int, Any] = {}  # label index -> the key that gave its weight
        for key, value in weights.items():
            if isinstance(key, str):
                if key not in names:
                    msg = (f"WeightedSampler(weights={{...}}) names class {key!r}, which is not "
                           f"one of the dataset's classes {names[:10]}; use a class name or a "
                           f"label index")
                    raise ConfigError(msg)
                index = names.index(key)
            elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
                index = int(key)
            else:
                msg = (f"WeightedSampler(weights={{...}}) has key {key!r}; use class names "
                       f"(str) or label indices (int)")
                raise ConfigError(msg)
            if not 0 <= index < per_class.size:
                msg = (f"WeightedSampler(weights={{...}}) has label index {index}, expected one "
                       f"in [0, {per_class.size}); use the dataset's label indices")
                raise ConfigError(msg)
            if index in named:
                msg = (f"WeightedSampler(weights={{...}}) names class {index} twice, as "
                       f"{named[index]!r} and {key!r}; give each class one weight")
                raise ConfigError(msg)
            named[index] = key
            try:
                per_class[index] = float(value)
            except (TypeError, ValueError):
                msg = (f"WeightedSampler(weights={{...}}) gives class {key!r} the weight "
                       f"{value!r}; weights must be numbers")
                raise ConfigError(msg) from None
        w = per_class[labels] if n else np.zeros(0)
    else:
        try:
            w = to_numpy(weights, dtype=np.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            msg = (f"WeightedSampler(weights=...) must be numbers, one per sample (or a dict "
                   f"{{class: weight}}), got {type(weights).__name__} ({exc})")
            raise ConfigError(msg) from None
        if w.size != n:
            msg = (f"WeightedSampler(weights=...) needs one weight per sample: expected {n}, "
                   f"got {w.size}; pass per-class weights as a dict {{class: weight}}")
            raise ConfigError(msg)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        bad = ~np.isfinite(w) | (w < 0)
        k = int(np.flatnonzero(bad)[0])
        msg = (f"WeightedSampler(weights=...) must be finite and >= 0: {int(bad.sum())} "
               f"are not, the first sample {k}'s ({float(w[k])}); fix the weights")
        raise ConfigError(msg)
    if class_balanced and n:
        counts = np.bincount(labels)
        w = w / counts[labels]
    top = float(w.max(initial=0.0))
    if top > 0.0:
        w = w / top  # only their ratios matter; this keeps the sum finite
    total = float(w.sum())
    if not total > 0.0:
        msg = "WeightedSampler weights are all zero; give at least one sample a positive weight"
        raise ConfigError(msg)
    return w / total


def without(probs: np.ndarray, aside: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """``probs`` with the ids ``aside`` at 0 (not normalized). With ``labels`` (class-balanced
    probabilities) each class keeps its share: its other samples take the share of those set
    aside, as if the class had been counted without them (a class left with none loses it)."""
    probs = probs.copy()
    probs[aside] = 0.0
    if labels is None or not len(labels):
        return probs
    labels = np.asarray(labels)
    counts = np.bincount(labels)
    active = np.ones(len(labels), dtype=bool)
    active[aside] = False
    left = np.bincount(labels[active], minlength=counts.size)
    scale = np.divide(counts, left, out=np.zeros(counts.size), where=left > 0)
    return probs * scale[labels]


def prior_probabilities(prior: Any, manifest: Any) -> np.ndarray:
    """A loss-driven sampler's ``prior`` resolved against the dataset's labels: a
    ``WeightedSampler`` (its ``weights`` and ``class_balanced``), one weight per sample, or a
    mapping ``{class: weight}``; validated as :func:`static_probabilities` does."""
    weights, balanced = prior, False
    if isinstance(prior, WeightedSampler):
        weights, balanced = prior.weights, prior.class_balanced
    return static_probabilities(manifest.labels, weights=weights, class_balanced=balanced,
                                classes=getattr(manifest, "classes", None))


def draw_units(manifest: Any, epoch: int, ids: np.ndarray, rng: np.random.Generator,
               block_rows: int) -> list[ReadUnit]:
    """Read units of about ``block_rows`` for ids drawn in random order (repeats allowed).

    For Parquet the ids are sorted first, so a unit's ids are neighbours and read few row
    groups; the units' order and the rows inside each unit are then shuffled.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if manifest.format != "parquet":
        return chunk_units(epoch, ids, block_rows)
    units = chunk_units(epoch, np.sort(ids), block_rows)
    order = rng.permutation(len(units))
    units = [units[j] for j in order]
    for index, u in enumerate(units):
        u.index = index
        u.ids = rng.permutation(np.asarray(u.ids))
    return units


class WeightedSampler:
    """Draws each epoch's ids in proportion to static weights, like torch's WeightedRandomSampler.

    Weights are given up front: per sample, per class, or ``class_balanced=True`` for equal
    draws of every class. An epoch is ``samples_per_epoch`` draws (default: the dataset's
    size) with replacement, reproducible from ``(seed, epoch)``. The batch's ``prob`` is the
    draw probability ``P_i`` and ``weight`` the importance weight
    ``(N * P_i)**-beta / max_j (N * P_j)**-beta`` (all 1 with the default ``beta = 0``: the
    model then trains on the re-weighted distribution, as with torch's sampler). Samples set
    aside as unreadable are not drawn again. No priority store is involved.

    Args:
        weights: None, one weight per sample, or a dict ``{class name or index: weight}``
            (classes it leaves out weigh 1).
        class_balanced: divide every weight by its class's size (equal draws per class).
        seed: the seed of the plans.
        samples_per_epoch: draws per epoch; default the dataset's size.
        beta: importance-weight exponent in ``[0, 1]``.
    """

    name = "weighted"
    lazy = False
    uses_store = False
    handle = None
    store_name = None

    def __init__(self, weights: Any = None, class_balanced: bool = False, seed: int = 0, *,
                 samples_per_epoch: int | None = None, beta: float = 0.0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            msg = f"WeightedSampler(seed=...) must be a non-negative int, got {seed!r}"
            raise ConfigError(msg)
        if samples_per_epoch is not None and (
                isinstance(samples_per_epoch, bool)
                or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch < 1):
            msg = (f"WeightedSampler(samples_per_epoch=...) must be an int >= 1 or None, got "
                   f"{samples_per_epoch!r}")
            raise ConfigError(msg)
        if not 0.0 <= beta <= 1.0:
            msg = f"WeightedSampler(beta=...) must be in [0, 1], got {beta!r}"
            raise ConfigError(msg)
        self.weights = weights
        self.class_balanced = bool(class_balanced)
        self.seed = int(seed)
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        self.beta = float(beta)
        self._probs: np.ndarray | None = None
        self._inputs_digest: str | None = None  # of what the probabilities are made from
        self._aside = SetAside()

    def __repr__(self) -> str:
        kind = "None" if self.weights is None else type(self.weights).__name__
        return (f"WeightedSampler(weights={kind}, class_balanced={self.class_balanced}, "
                f"seed={self.seed})")

    def bind(self, manifest: Any, *, name: str) -> None:
        """Resolve the weights against the dataset's labels (validated here)."""
        self._probs = self.probabilities(manifest)
        self._inputs_digest = self._digest(manifest.labels)

    def probabilities(self, manifest: Any) -> np.ndarray:
        """The draw probability of every id (before ids set aside are left out)."""
        return static_probabilities(manifest.labels, weights=self.weights,
                                    class_balanced=self.class_balanced,
                                    classes=getattr(manifest, "classes", None))

    def plan(self, manifest: Any, epoch: int, *, block_rows: int) -> EpochPlan:
        """``samples_per_epoch`` draws with replacement, in units of about ``block_rows``."""
        probs = self._probs if self._probs is not None else self.probabilities(manifest)
        aside = self._aside.for_plan(epoch)
        if aside.size:
            probs = without(probs, aside, manifest.labels if self.class_balanced else None)
            if not probs.sum() > 0.0:
                msg = ("WeightedSampler: every sample with a positive weight was set aside as "
                       "unreadable; nothing is left to draw")
                raise ConfigError(msg)
            probs /= probs.sum()
        n = len(manifest)
        k = self.samples_per_epoch or n
        rng = np.random.default_rng([self.seed, int(epoch), _PLAN_STREAM])
        ids = rng.choice(n, size=k, replace=True, p=probs).astype(np.int64)
        units = draw_units(manifest, epoch, ids, rng, block_rows)
        set_occurrences(units)  # each draw of an id augmented apart
        positive = probs[probs > 0]
        low = float(positive.min())
        for u in units:
            p = probs[u.ids]
            u.probs = p
            u.weights = importance_weights(p, size=n, min_prob=low,
                                           beta=self.beta).astype(np.float32)
        return EpochPlan(epoch=epoch, units=units, sampler=self.name)

    def fill(self, unit: ReadUnit) -> ReadUnit:
        """Units are complete when planned."""
        return unit

    def report(self, ids: Any, losses: Any) -> None:
        """Losses do not change static weights; they are checked as a prioritized
        sampler checks them (from their metadata: nothing is copied off a device) and dropped."""
        from raying.sampling.feedback import check_report

        check_report(ids, losses)

    def set_aside(self, ids: Any) -> None:
        """Samples that failed to read are not drawn in epochs planned later."""
        self._aside.add(ids)

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self, *, release_store: bool = True) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sampler": self.name, "seed": self.seed,
                               "class_balanced": self.class_balanced}
        if self._probs is not None:
            out["prob_min"] = float(self._probs.min())
            out["prob_max"] = float(self._probs.max())
        return out

    def _digest(self, labels: Any) -> str:
        """A digest of what the draw probabilities are made from: the labels, the weights
        and class_balanced (exact inputs, not the computed floats, whose last bits may differ
        on another machine's numpy)."""
        h = hashlib.blake2b(digest_size=12)
        h.update(np.ascontiguousarray(labels, np.int64).tobytes())
        h.update(b"balanced" if self.class_balanced else b"as given")
        weights = self.weights
        if weights is None:
            h.update(b"none")
        elif isinstance(weights, Mapping):
            h.update(repr(sorted((str(k), float(v)) for k, v in weights.items())).encode())
        else:
            h.update(np.ascontiguousarray(to_numpy(weights, dtype=np.float64)).tobytes())
        return h.hexdigest()

    def _probs_digest(self) -> str | None:
        """The bound draw probabilities' digest (:meth:`_digest`), None before bind."""
        return self._inputs_digest

    def state_dict(self) -> dict[str, Any]:
        out = {"sampler": self.name, "seed": self.seed,
               "samples_per_epoch": self.samples_per_epoch, **self._aside.state()}
        digest = self._probs_digest()
        if digest is not None:
            out["probs_digest"] = digest
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sampler") != self.name or state.get("seed") != self.seed:
            msg = (f"state was saved by {state.get('sampler')!r} with seed "
                   f"{state.get('seed')!r}; this pipeline has WeightedSampler(seed="
                   f"{self.seed}); build it with the saved sampler and seed")
            raise ConfigError(msg)
        # The draws follow the probabilities and their count: another of either is another
        # plan, and the saved position would repeat or skip draws (an older state has neither).
        if state.get("samples_per_epoch", self.samples_per_epoch) != self.samples_per_epoch:
            msg = (f"state was saved with WeightedSampler(samples_per_epoch="
                   f"{state['samples_per_epoch']!r}) but this pipeline has samples_per_epoch="
                   f"{self.samples_per_epoch!r}; build it with the saved setting")
            raise ConfigError(msg)
        saved, mine = state.get("probs_digest"), self._probs_digest()
        if saved is not None and mine is not None and saved != mine:
            msg = ("state was saved by a WeightedSampler whose draw probabilities differ from "
                   "this pipeline's (other weights, class_balanced or labels): its plan is "
                   "another one, so the saved position would repeat or skip draws; build it "
                   "with the saved weights")
            raise ConfigError(msg)
        self._aside.load(state)
