"""The priority store: a restartable, optionally sharded Ray actor behind a few functions."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import ray

from raying.errors import ConfigError, RayingError
from raying.options import StorageOptions, StoreConfig
from raying.sampling.store_actor import StoreActor
from raying.sampling.table import TableConfig
from raying.sampling.weights import REJECT_REASONS, check_updates, importance_weights


def ray_session() -> str | None:
    """This process's Ray connection, as ``<GCS address>/<job id>``; None without Ray. It
    changes with ``ray.shutdown()`` and ``ray.init()`` (a new job even on the same cluster),
    which take every object reference and actor handle of the old one with them."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


# How long a call that waits for the store (a plan, stats, a snapshot) may take.
DEFAULT_STORE_CALL_TIMEOUT_S = 60.0
# How long creating the actors (and restoring their snapshots) may take.
DEFAULT_STORE_START_TIMEOUT_S = 120.0
# Times Ray resubmits a call that was in flight when the actor died (then restarted).
DEFAULT_STORE_TASK_RETRIES = 3


class StoreTimeoutError(RayingError, TimeoutError):
    """The priority store did not answer in time."""


@dataclasses.dataclass(frozen=True)
class StoreHandle:
    """Where a store's actors are; picklable, so tasks and Train workers can hold it.

    Reporters send updates, samplers ask for plans, and the actors apply updates once per tick::

        reporters --update_async--> [queue] --tick: coalesce, apply, age, snapshot--> table
        samplers  --sample_plan---> apply queue, draw ids --> Plan(ids, probs, size, min_prob)

    Attributes:
        name: the store's name (its first actor's name).
        namespace: the Ray namespace of the actors, or None for the job's.
        n: number of ids.
        bounds: first id of each shard, then ``n``.
        actors: one actor handle per shard.
        uniform_mix: the table's ``eps``, to combine shards exactly.
    """

    name: str
    namespace: str | None
    n: int
    bounds: tuple[int, ...]
    actors: tuple[Any, ...]
    uniform_mix: float


class Plan(NamedTuple):
    """Ids drawn from the store and what a trainer needs to correct for the sampling.

    Attributes:
        ids: int64 sample ids.
        probs: float64 probability of each id under the store's distribution at plan time.
        size: number of ids ``N`` of the whole store.
        min_prob: least positive probability over all ids (normalises the weights).
    """

    ids: np.ndarray
    probs: np.ndarray
    size: int
    min_prob: float

    def weights(self, beta: float) -> np.ndarray:
        """Importance weights ``(N*P)**-beta / (N*min_prob)**-beta``, in ``(0, 1]``."""
        return importance_weights(self.probs, size=self.size, min_prob=self.min_prob, beta=beta)


def _actor_class():
    return ray.remote(StoreActor)


def _get(refs: Any, what: str, name: str, timeout_s: float = DEFAULT_STORE_CALL_TIMEOUT_S):
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        msg = (f"priority store {name!r} did not answer {what} within {timeout_s:g} s; check "
               f"that it is alive (ray list actors) and not overloaded")
        raise StoreTimeoutError(msg) from None


# Ray gives the head node this resource (Ray Serve pins its controller with it too).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def head_placement() -> dict[str, Any]:
    """Actor options that pin an actor of no CPU to the head node, where there is one."""
    return _placement(None)


def _placement(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The store's actor options: the caller's, or a pin to the head node when there is one.

    Soft node affinity does not hold 0-CPU actors in Ray 2.60 (measured: 1 of 4 landed on the
    target node), so the head is asked for by its resource.
    """
    if options is not None:
        return dict(options)
    has_head = any(node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {})
                   for node in ray.nodes())
    return {"resources": {HEAD_NODE_RESOURCE: 0.001}} if has_head else {}


def _shard_name(name: str, shard: int) -> str:
    return name if shard == 0 else f"{name}.shard-{shard:05d}"


def create_store(name: str, n: int, *, table: TableConfig | Mapping[str, Any] | None = None,
                 config: StoreConfig | Mapping[str, Any] | None = None,
                 namespace: str | None = None, prior: Any = None,
                 wait: bool = True) -> StoreHandle:
    """Start a named priority store for ids ``0 .. n-1`` and wait until it is ready.

    Args:
        name: the store's name; other processes reach it with ``get_store(name)``.
        n: number of ids.
        table: PriorityTable settings (alpha, uniform_mix, beta, cap_quantile, ...).
        config: StoreConfig settings (coalescing, tick, snapshots, sharding).
        namespace: Ray namespace of the actors; None uses the job's.
        prior: static weights of the ids (see ``PriorityTable``), or None; a store with a
            prior is one shard.
        wait: wait for the actors' start here. With False the call returns at once; pass
            the handle to :func:`wait_ready` before the first call that needs an answer
            (its errors and the start's timeout surface there).

    Returns:
        A picklable handle for the other functions of this module.

    Example:
        >>> h = create_store("prio", 1_000_000, table={"alpha": 0.6, "uniform_mix": 0.1},
        ...                  config={"snapshot_uri": "s3://bucket/prio"})
        >>> update_async(h, ids, losses); plan = sample_plan(h, 4096)
    """
    from raying.storage import files as storage
    from raying.storage.spec import travelling_options

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        msg = f"n must be an integer >= 1 (the number of samples), got {n!r}"
        raise ConfigError(msg)
    table_cfg = TableConfig.coerce(table)
    cfg = StoreConfig.coerce(config)
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        msg = (f"a priority store named {name!r} already exists in namespace {namespace!r}; "
               f"reach it with get_store({name!r}) or remove it with kill_store first")
        raise ConfigError(msg)
    bounds = tuple(range(0, int(n), cfg.shard_rows)) + (int(n),)
    if prior is not None and len(bounds) > 2:
        msg = (f"a prior needs the priority store in one shard: {n} ids exceed "
               f"StoreConfig(shard_rows={cfg.shard_rows}); raise shard_rows to at least {n}")
        raise ConfigError(msg)
    directory = None
    snapshot_storage = cfg.storage
    if cfg.snapshot_uri is not None:
        # Fail here, not inside the actor.
        storage.resolve(cfg.snapshot_uri, StorageOptions.coerce(cfg.storage))
        # The actors are Ray workers: they get the endpoint this process resolved.
        snapshot_storage = travelling_options(cfg.snapshot_uri, cfg.storage)
        directory = cfg.snapshot_uri.rstrip("/")
        if "://" not in directory:  # the actor's working directory may differ from ours
            directory = os.path.abspath(os.path.expanduser(directory))
    layout = {"bounds": bounds, "uniform_mix": table_cfg.uniform_mix}
    options = {"coalesce": cfg.coalesce, "ema": cfg.ema, "tick_s": cfg.tick_s,
               "snapshot_every_updates": cfg.snapshot_every_updates,
               "snapshot_interval_s": cfg.snapshot_interval_s, "storage": snapshot_storage,
               "restore": cfg.restore}
    actors = []
    placement = _placement(cfg.actor_options)
    for shard, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        path = None if directory is None else f"{directory}/{name}.shard-{shard:05d}.npz"
        actor = _actor_class().options(
            name=_shard_name(name, shard), namespace=namespace, num_cpus=0, max_restarts=-1,
            max_task_retries=DEFAULT_STORE_TASK_RETRIES, **placement,
        ).remote(_shard_name(name, shard), lo, hi - lo, dataclasses.asdict(table_cfg),
                 options, path, layout, prior)
        actors.append(actor)
    handle = StoreHandle(name, namespace, int(n), bounds, tuple(actors), table_cfg.uniform_mix)
    if wait:
        wait_ready(handle)
    return handle


def wait_ready(handle: StoreHandle, refs: list[Any] | None = None, *,
               timeout_s: float = DEFAULT_STORE_START_TIMEOUT_S) -> bool:
    """Wait until every actor of the store has started (restored its snapshot included).

    ``refs`` are the actors' ``ready`` calls of an earlier look (:func:`start_refs`), so
    looking again sends nothing. With ``timeout_s=0`` it only looks: True when all have
    started, else False. Otherwise it raises StoreTimeoutError after ``timeout_s``, or the
    actor's error if its start failed.
    """
    refs = start_refs(handle) if refs is None else refs
    if timeout_s == 0:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) < len(refs):
            return False
    _get(refs, "its start", handle.name, timeout_s or DEFAULT_STORE_START_TIMEOUT_S)
    return True


def start_refs(handle: StoreHandle) -> list[Any]:
    """One ``ready`` call per actor: they answer once the actor has started."""
    return [a.ready.remote() for a in handle.actors]


def get_store(name: str, *, namespace: str | None = None) -> StoreHandle:
    """Reach a running store by name (from a task, a Train worker or another driver)."""
    try:
        first = ray.get_actor(name, namespace=namespace)
    except ValueError:
        msg = (f"no priority store named {name!r} in namespace {namespace!r}; create it with "
               f"create_store({name!r}, n) in the driver first")
        raise ConfigError(msg) from None
    layout = _get(first.layout.remote(), "its layout", name)
    bounds = tuple(layout["bounds"])
    actors = [first] + [ray.get_actor(_shard_name(name, s), namespace=namespace)
                        for s in range(1, len(bounds) - 1)]
    return StoreHandle(name, namespace, bounds[-1], bounds, tuple(actors), layout["uniform_mix"])


def update_async(handle: StoreHandle, ids: Any, priorities: Any, *,
                 exact: bool = False) -> None:
    """Send priority updates without waiting (no ``ray.get``): the training step never blocks.

    Invalid entries (NaN, inf, negative, out-of-range or non-integral ids, length mismatch)
    are dropped here and counted in the store's ``rejected`` stats. ``exact``: the store
    writes the values as given, not folded by its coalesce mode (see ``StoreActor.update``).
    """
    ids, values, rejected = check_updates(ids, priorities, handle.n)
    # ``exact`` only when set: a store of an older raying (found by name) takes 3 arguments.
    more = (True,) if exact else ()
    if len(handle.actors) == 1:
        handle.actors[0].update.remote(ids, values, rejected or None, *more)
        return
    shard = np.searchsorted(handle.bounds, ids, side="right") - 1
    for s, actor in enumerate(handle.actors):
        mine = shard == s
        extra = rejected if s == 0 else None
        if mine.any() or extra:
            actor.update.remote(ids[mine] - handle.bounds[s], values[mine], extra or None,
                                *more)


def sample_plan(handle: StoreHandle, k: int, *, systematic: bool = False) -> Plan:
    """Draw ``k`` ids (ask for >= 4096 per call: the cost is per call, not per id).

    Updates that reached the store before this call are applied first. A sharded store draws
    in two levels with exact global probabilities; the plan is exact for the state at plan
    time, except for updates applied between its two calls (they are one round trip apart).

    Args:
        handle: from create_store or get_store.
        k: number of ids.
        systematic: a stratified plan (ids in ascending order, each ``floor``/``ceil`` of
            ``k*P``) instead of i.i.d. draws (random order).
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        msg = f"k must be an integer >= 0 (the number of ids in the plan), got {k!r}"
        raise ConfigError(msg)
    if len(handle.actors) == 1:
        ids, probs, size, min_prob = _get(
            handle.actors[0].sample.remote(int(k), bool(systematic)), "a plan", handle.name)
        return Plan(ids, probs, size, min_prob)
    infos = _get([a.prepare.remote() for a in handle.actors], "a plan", handle.name)
    a, b, min_prob = _global_mixture(infos, handle.n, handle.uniform_mix)
    masses = np.array([a * info["total"] + b * info["n"] for info in infos])
    ends = np.cumsum(masses)
    rng = np.random.default_rng(infos[0]["seed"])
    if systematic:
        positions = (np.arange(k, dtype=np.float64) + rng.random()) / max(k, 1) * ends[-1]
    else:
        positions = rng.random(k) * ends[-1]
    # A zero-mass shard is never chosen; rounding past the end goes to the last live shard.
    shard = np.minimum(np.searchsorted(ends, positions, side="right"),
                       int(np.flatnonzero(masses > 0)[-1]))
    starts = ends - masses
    ids = np.empty(k, dtype=np.int64)
    probs = np.empty(k, dtype=np.float64)
    calls = []
    for s in np.unique(shard):
        where = np.flatnonzero(shard == s)
        local = np.clip(positions[where] - starts[s], 0.0, masses[s])
        calls.append((where, handle.actors[s].locate.remote(local, a, b)))
    results = _get([ref for _, ref in calls], "a plan", handle.name)
    for (where, _), (got_ids, got_probs) in zip(calls, results, strict=True):
        ids[where] = got_ids
        probs[where] = got_probs
    return Plan(ids, probs, handle.n, min_prob)


def sample_grouped_plan(handle: StoreHandle, k: int, starts: np.ndarray,
                        rows_per_group: int) -> Plan:
    """A two-stage plan that keeps reads local: groups by mass, then rows inside them.

    ``starts`` are the first ids of contiguous groups (Parquet row groups). The probability of
    each id is exact (see ``PriorityTable.sample_in_groups``). A sharded store draws a plain
    plan instead (groups may straddle shards); reads then touch more row groups.
    """
    if len(handle.actors) != 1:
        return sample_plan(handle, k)
    ids, probs, size, min_prob = _get(
        handle.actors[0].sample_in_groups.remote(int(k), np.asarray(starts, np.int64),
                                                 int(rows_per_group)),
        "a plan", handle.name)
    return Plan(ids, probs, size, min_prob)


def _global_mixture(infos: list[dict[str, Any]], n: int, eps: float) -> tuple[float, float, float]:
    """``(a, b, min_prob)`` with ``P_i = a * p_i**alpha + b`` over all shards."""
    total = math.fsum(info["total"] for info in infos)
    a, b = ((1.0 - eps) / total, eps / n) if total > 0.0 else (0.0, 1.0 / n)
    if len(infos) == 1 and "min_prob" in infos[0]:  # a prior: the table's own exact figure
        return a, b, infos[0]["min_prob"]
    if total <= 0.0:
        return a, b, b
    if b > 0.0:
        return a, b, a * min(info["min"] for info in infos) + b
    return a, b, a * min(info["min_positive"] for info in infos)


def stats(handle: StoreHandle) -> dict[str, Any]:
    """Health of the store: updates, rejections, coalescing, snapshots, total, ESS, ages."""
    shards = _get([a.stats.remote() for a in handle.actors], "stats", handle.name)
    a, b, min_prob = _global_mixture([s["leaves"] for s in shards], handle.n,
                                     handle.uniform_mix)
    sum_p2 = math.fsum(a * a * s["leaves"]["sum_sq"] + 2 * a * b * s["leaves"]["cross"]
                       + s["leaves"]["floor_sq"] * b * b for s in shards)
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    for s in shards:
        for reason, count in s["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + count
    ages = [s["age"] for s in shards]
    weights = [s["leaves"]["n"] / handle.n for s in shards]
    age = ages[0] if len(ages) == 1 else {
        "mean": sum(w * g["mean"] for w, g in zip(weights, ages, strict=True)),
        "max": max(g["max"] for g in ages),
        "never_updated_share": sum(w * g["never_updated_share"]
                                   for w, g in zip(weights, ages, strict=True)),
        "stale_share": None if ages[0]["stale_share"] is None else sum(
            w * g["stale_share"] for w, g in zip(weights, ages, strict=True))}
    times = [s["last_snapshot_time"] for s in shards if s["last_snapshot_time"] is not None]

    def total_of(key: str, part: str = "counters") -> int:
        return sum(s[part][key] for s in shards)

    return {"name": handle.name, "n": handle.n, "shards": len(shards),
            "updates_received": total_of("received"),
            "updates_applied": total_of("updates_applied", "table_counters"),
            "coalesced": total_of("coalesced"), "rejected": rejected,
            "pending": sum(s["pending"] for s in shards),
            "samples": total_of("samples", "table_counters"),
            "snapshots": total_of("snapshots"), "snapshot_errors": total_of("snapshot_errors"),
            "last_snapshot_time": min(times) if len(times) == len(shards) else None,
            "last_snapshot_error": next((s["last_snapshot_error"] for s in shards
                                         if s["last_snapshot_error"]), None),
            "updates_since_snapshot": sum(s["updates_since_snapshot"] for s in shards),
            "restores": total_of("restores"), "restored_updates": total_of("restored_updates"),
            "restarts": total_of("restarts"),
            "total": math.fsum(s["leaves"]["total"] for s in shards),
            "ess": 1.0 / sum_p2, "ess_fraction": 1.0 / sum_p2 / handle.n,
            "min_prob": min_prob, "age": age, "guard": _guard_stats(shards)}


def _guard_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The noisy-label guard over all shards: rows held, and the share of the top priorities
    (rows at or above the high-loss threshold) that are persistently high-loss."""
    parts = [s.get("guard") or {} for s in shards]
    top = sum(int(g.get("top_rows", 0)) for g in parts)
    persistent = sum(int(g.get("persistent_top", 0)) for g in parts)
    return {"guarded_rows": sum(int(g.get("guarded", 0)) for g in parts),
            "top_rows": top,
            "persistent_top_share": persistent / top if top else None,
            "threshold": parts[0].get("threshold") if parts else None}


def priorities(handle: StoreHandle, ids: Any = None) -> np.ndarray:
    """The stored priorities of ``ids`` (all when None), after applying queued updates."""
    if ids is None:
        parts = _get([a.priorities.remote() for a in handle.actors], "priorities", handle.name)
        return np.concatenate(parts)
    ids = np.asarray(ids, dtype=np.int64)
    shard = np.searchsorted(handle.bounds, ids, side="right") - 1
    out = np.empty(ids.size, dtype=np.float64)
    calls = [(shard == s, handle.actors[s].priorities.remote(ids[shard == s] - handle.bounds[s]))
             for s in np.unique(shard)]
    for mask, part in zip([m for m, _ in calls],
                          _get([r for _, r in calls], "priorities", handle.name), strict=True):
        out[mask] = part
    return out


def scores(handle: StoreHandle) -> np.ndarray:
    """Every id's latest reported loss, NaN where none was reported (after queued updates)."""
    return np.concatenate(_get([a.scores.remote() for a in handle.actors], "scores",
                               handle.name))


def flush(handle: StoreHandle) -> None:
    """Wait until every update this process sent has been applied (Ray keeps per-caller order)."""
    _get([a.flush.remote() for a in handle.actors], "a flush", handle.name)


def snapshot_now(handle: StoreHandle) -> list[dict[str, Any] | None]:
    """Apply queued updates and write a snapshot of every shard now (None: no snapshot URI)."""
    return _get([a.snapshot_now.remote() for a in handle.actors], "a snapshot", handle.name)


def state_dict(handle: StoreHandle) -> list[dict[str, Any]]:
    """The table state of every shard (for a pipeline's ``state_dict``)."""
    return _get([a.state_dict.remote() for a in handle.actors], "its state", handle.name)


def load_state_dict(handle: StoreHandle, states: list[dict[str, Any]]) -> None:
    """Replace every shard's table state with one from ``state_dict``."""
    if len(states) != len(handle.actors):
        msg = (f"store state has {len(states)} shard(s), store {handle.name!r} has "
               f"{len(handle.actors)}; create the store with the same n and shard_rows")
        raise ConfigError(msg)
    _get([a.load_state_dict.remote(s) for a, s in zip(handle.actors, states, strict=True)],
         "a state load", handle.name)


def kill_store(handle: StoreHandle, *, snapshot: bool = True) -> None:
    """Stop the store for good and wait until its name is free.

    Args:
        handle: the store.
        snapshot: first write a snapshot (when the store has a snapshot URI).
    """
    if snapshot:
        snapshot_now(handle)
    for actor in handle.actors:
        ray.kill(actor, no_restart=True)
    # The kill is asynchronous; wait until the names are free so the store can be recreated.
    deadline = time.monotonic() + DEFAULT_STORE_CALL_TIMEOUT_S
    for shard in range(len(handle.actors)):
        while time.monotonic() < deadline:
            try:
                ray.get_actor(_shard_name(handle.name, shard), namespace=handle.namespace)
            except ValueError:
                break
            time.sleep(0.02)
