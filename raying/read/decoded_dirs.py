"""Where the decoded-sample cache lives on each node, who owns it, and when it goes.

Every node keeps its own copy, in its own tmpfs: a read task caches what it decodes on the
node it runs on, under ``RAYING_DECODED_CACHE_DIR`` (default ``/dev/shm/raying-decoded``) as
that node's environment sets it. With ``"auto"``, each node also caps the driver's budget at
its own share of free memory. ``Pipeline.close`` removes the pipeline's directory on every
node that is alive; a pipeline's start sweeps, on every node, the directories of pipelines
whose driver died without closing (its process gone, or its Ray job finished), never a live
one's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from typing import Any

from raying.errors import ConfigError
from raying.read.cache.pids import alive as pid_alive

logger = logging.getLogger(__name__)

DEFAULT_DECODED_CACHE_DIR = "/dev/shm/raying-decoded"
# The environment variable that moves a node's decoded-cache root (read on that node).
DECODED_CACHE_DIR_ENV = "RAYING_DECODED_CACHE_DIR"
# Seconds close() and the start's sweep wait for the other nodes' clean-up tasks.
DEFAULT_NODE_TASK_TIMEOUT_S = 30.0


def root() -> str:
    """This node's decoded-cache root (``RAYING_DECODED_CACHE_DIR`` or the default)."""
    return os.environ.get(DECODED_CACHE_DIR_ENV) or DEFAULT_DECODED_CACHE_DIR


def cache_dir(pipeline_name: str) -> str:
    """The pipeline's own tier directory on this node (removed by ``Pipeline.close``)."""
    return os.path.join(root(), pipeline_name)


_OWNER = ".owner"
# A directory without an owner file this old is a leftover (removed at the next start).
DEFAULT_ORPHAN_AGE_S = 600
# Pipelines released on this node: read tasks still running (keep_warm, the window in flight)
# must not re-create their directory after close.
_RELEASED = ".released"


def _tombstone(pipeline_name: str) -> str:
    return os.path.join(root(), _RELEASED, pipeline_name)


# The pipelines of this process whose directories its exit frees (one exit hook for all).
_CLAIMED: set[str] = set()
_CLAIMED_LOCK = threading.Lock()


def _release_claimed() -> None:
    with _CLAIMED_LOCK:
        names = sorted(_CLAIMED)
    for name in names:
        release(name)


def release(pipeline_name: str) -> None:
    """Remove the pipeline's decoded pixels from this node's memory; its read tasks still in
    flight stop using the cache (see :meth:`DecodedCache.of`)."""
    with _CLAIMED_LOCK:
        _CLAIMED.discard(pipeline_name)
    try:
        os.makedirs(os.path.dirname(_tombstone(pipeline_name)), exist_ok=True)
        with open(_tombstone(pipeline_name), "w"):
            pass
    except OSError:
        pass
    # A read task's write already past its tombstone check may put a file into a folder the
    # removal has listed (and make its fan-out folder again): the removal is tried again
    # until the folder is gone, for as long as such a write takes.
    path = cache_dir(pipeline_name)
    for wait_s in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
        time.sleep(wait_s)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
    logger.warning("raying: the decoded cache folder %s of closed pipeline %s could not be "
                   "removed; a later pipeline start on this node sweeps it", path,
                   pipeline_name)


def released(directory: str) -> bool:
    """Whether the pipeline that owns the decoded-cache ``directory`` was closed."""
    return os.path.exists(_tombstone(os.path.basename(directory.rstrip("/"))))


def close_released() -> int:
    """Close this process's handles on the decoded caches of closed pipelines (their index
    and lock files; see ``tiered.close_finished``). Every read of a decoded cache calls it,
    so a read worker lets go of a closed pipeline's files at its next read of any pipeline."""
    from raying.read.cache.tiered import close_finished

    base = os.path.abspath(root())
    return close_finished(lambda d: os.path.dirname(os.path.abspath(d)) == base
                          and released(d))


def owner_id() -> str:
    """Who owns the directories this process's pipelines create, as the owner file holds it:
    ``host pid [gcs-address job-id]`` (the Ray part when Ray is up)."""
    import socket

    owner = f"{socket.gethostname()} {os.getpid()}"
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            owner += f" {ctx.gcs_address} {ctx.get_job_id()}"
    except Exception:  # noqa: BLE001 - the host and pid still identify the owner here
        pass
    return owner


def _owner_dead(owner: str, dead_jobs: frozenset[str], gcs: str | None) -> bool:
    """Whether the owner recorded as ``owner`` is gone, as far as this node can tell: its
    process, when it ran on this host; else its Ray job, when it ran on this cluster."""
    import socket

    parts = owner.split()
    if len(parts) < 2:
        raise ValueError(owner)
    host, pid = parts[0], int(parts[1])
    if host == socket.gethostname():
        return not pid_alive(pid)
    if len(parts) >= 4 and gcs is not None and parts[2] == gcs:
        return parts[3] in dead_jobs
    return False  # another host of another cluster: nothing here can tell


def mark_owner(directory: str, owner: str) -> None:
    """Record ``owner`` in a pipeline's directory on this node, unless one is recorded."""
    path = os.path.join(directory, _OWNER)
    if owner and not os.path.exists(path):
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(owner)
        except OSError:
            pass


_BUDGET = ".budget"
_BUDGETS: dict[str, tuple[int, Any]] = {}  # directory -> (budget, its record's identity)


def node_budget(directory: str, measure: Any) -> int:
    """The ``"auto"`` budget of a pipeline's cache on this node: measured (``measure()``) by
    the first process that opens the directory, then read back by every other one.

    Each process measuring its own would not do: free memory and free tmpfs space fall as
    the cache fills, so a worker started later would open the same directory with a smaller
    capacity, admit a smaller subset, and its writes would evict what the others cached. A
    process's reading of the record holds while the record does (a pipeline built again
    under a closed one's name records its own).
    """
    path = os.path.join(directory, _BUDGET)

    def identity() -> Any:
        st = os.stat(path)
        return (st.st_ino, st.st_mtime_ns)

    try:
        key = identity()
        memo = _BUDGETS.get(directory)
        if memo is not None and memo[1] == key:
            return memo[0]
        with open(path) as fh:
            got = int(fh.read())
    except (OSError, ValueError):
        memo = _BUDGETS.get(directory)
        if memo is not None and memo[1] is None:  # no record could be made here: as before
            return memo[0]
        got = int(measure())
        key = None
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "w") as fh:
                fh.write(str(got))
            try:
                os.link(tmp, path)  # the first to link it decides; the file is whole by then
            except FileExistsError:
                with open(path) as fh:
                    got = int(fh.read())
            key = identity()
        except (OSError, ValueError):
            pass  # no shared record (a read-only root): this process's own measure
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _BUDGETS[directory] = (got, key)
    return got


def sweep(dead_jobs: frozenset[str] = frozenset(), gcs: str | None = None) -> list[str]:
    """Remove this node's directories of pipelines whose owner died without closing them, and
    old tombstones; returns the names removed."""
    removed = []
    base = root()
    if not os.path.isdir(base):
        return removed
    for entry in os.listdir(base):
        path = os.path.join(base, entry)
        if entry == _RELEASED:
            _sweep_tombstones(path)
            continue
        if not _ours(path):  # the root may be a folder others use too (/dev/shm itself)
            continue
        try:
            with open(os.path.join(path, _OWNER)) as fh:
                stale = _owner_dead(fh.read(), dead_jobs, gcs)
        except (OSError, ValueError):  # no owner: a late writer re-created it after close
            try:
                stale = time.time() - os.path.getmtime(path) > DEFAULT_ORPHAN_AGE_S
            except OSError:
                stale = False
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(entry)
    return removed


def _ours(path: str) -> bool:
    """Whether ``path`` is a pipeline's decoded-cache folder: it has an owner file, or the
    tier's layout (fan-out folders of two hex digits under ``data``) that a late write of a
    closed pipeline leaves."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if os.path.exists(os.path.join(path, _OWNER)):
        return True
    try:
        fanout = os.listdir(os.path.join(path, "data"))
    except OSError:
        return False
    return bool(fanout) and all(len(n) == 2 and all(c in "0123456789abcdef" for c in n)
                                for n in fanout)


def claim(pipeline_name: str, owner: str) -> None:
    """Mark the pipeline's directory on this node as owned by ``owner`` (this process, see
    :func:`owner_id`), free it at exit, and sweep every node of directories whose owner died
    without closing its pipeline (tmpfs is memory: a crashed driver must not keep gigabytes
    of pixels)."""
    import atexit

    # A closed pipeline of the same name (a fixed PipelineConfig(name=...), run again) left a
    # tombstone for its late read tasks: this pipeline's reads must not take it for theirs.
    on_every_node(_sweep_node, *_dead_jobs(), pipeline_name)
    path = cache_dir(pipeline_name)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, _OWNER), "w") as fh:
            fh.write(owner)
    except OSError as exc:
        set_by = (f"{DECODED_CACHE_DIR_ENV}={os.environ[DECODED_CACHE_DIR_ENV]!r}"
                  if os.environ.get(DECODED_CACHE_DIR_ENV) else f"the default {root()!r}")
        msg = (f"the decoded cache cannot make its folder {path} ({exc.strerror or exc}): "
               f"{set_by} must name a folder this process may create and write, on a memory "
               f"filesystem such as /dev/shm; set {DECODED_CACHE_DIR_ENV} to one, or build "
               f"the Pipeline with PipelineConfig(decoded_cache='off')")
        raise ConfigError(msg) from exc
    with _CLAIMED_LOCK:
        if not _CLAIMED_HOOK:
            atexit.register(_release_claimed)
            _CLAIMED_HOOK.append(True)
        _CLAIMED.add(pipeline_name)


_CLAIMED_HOOK: list[bool] = []  # the exit hook, once registered


def sweep_leftovers() -> None:
    """For a pipeline without a decoded cache: sweep the leftovers of pipelines whose driver
    died, as :func:`claim` does, without waiting for other nodes (nothing of this pipeline's
    waits on it); this node's folders only when it holds any."""
    base = root()
    try:
        here = [e for e in os.listdir(base) if e != _RELEASED]
    except OSError:
        here = []
    dead = _dead_jobs()
    if here:
        _sweep_node(*dead)
    on_every_node(_sweep_node, *dead, wait=False, here=False)


def release_everywhere(pipeline_name: str) -> None:
    """:func:`release` on this node and on every other node that is alive."""
    on_every_node(release, pipeline_name)


def _sweep_node(dead_jobs: frozenset[str], gcs: str | None,
                revive: str | None = None) -> list[str]:
    if revive is not None:  # a new pipeline of a closed one's name: its tombstone goes
        with contextlib.suppress(OSError):
            os.unlink(_tombstone(revive))
    return sweep(dead_jobs, gcs)


def _dead_jobs() -> tuple[frozenset[str], str | None]:
    """The finished Ray jobs of this cluster and its GCS address (empty without Ray)."""
    try:
        import ray
        from ray._private import state

        if not ray.is_initialized():
            return frozenset(), None
        dead = frozenset(j["JobID"] for j in state.jobs() if j.get("IsDead"))
        return dead, ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - without the job table only the pid rule applies
        return frozenset(), None


def on_every_node(fn: Any, *args: Any, wait: bool = True, here: bool = True) -> None:
    """Run ``fn(*args)`` here (unless ``here=False``), and in a zero-CPU task pinned to each
    other alive Ray node.

    Waits up to ``DEFAULT_NODE_TASK_TIMEOUT_S`` for them (unless ``wait=False``); a node that
    does not answer is logged (its leftovers are swept by the next pipeline started there).
    """
    import logging

    if here:
        fn(*args)
    try:
        import ray

        if not ray.is_initialized():
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
        if not others:
            return
        task = ray.remote(num_cpus=0, max_retries=1)(fn)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(*args) for node in others]
        if not wait:
            return
        ready, pending = ray.wait(refs, num_returns=len(refs),
                                  timeout=DEFAULT_NODE_TASK_TIMEOUT_S)
        errors = []
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))
        if pending or errors:
            logging.getLogger("raying").warning(
                "decoded cache: %s on %d of %d other nodes did not finish (%s); their "
                "leftovers go at the next pipeline's start there", fn.__name__,
                len(pending) + len(errors), len(others), "; ".join(errors[:3]) or "timeout")
    except Exception as exc:  # noqa: BLE001 - clean-up must not fail the caller
        logging.getLogger("raying").warning("decoded cache: %s on other nodes failed: %r",
                                            fn.__name__, exc)


def _sweep_tombstones(path: str) -> None:
    now = time.time()
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        try:
            if now - os.path.getmtime(os.path.join(path, name)) > DEFAULT_ORPHAN_AGE_S:
                os.unlink(os.path.join(path, name))
        except OSError:
            pass
