"""Ray set-up: the local Ray raying starts when none is up, with a bounded object store."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

from raying.errors import ConfigError, RayConnectionError
from raying.options import settings

# How long a RAY_ADDRESS's head may take to accept a connection before raying says it is down
# (ray.init itself retries a head that is down for minutes without a word).
DEFAULT_RAY_CONNECT_TIMEOUT_S = 10.0
# Ray's setting (a RayConfig entry, also read from the environment by its raylet) that names
# modules every worker imports as it starts, and the module raying names in it.
PRELOAD_ENV = "RAY_preload_python_modules"
PRELOAD_MODULE = "raying.engine.preload"
# Ray's raylet deletes the objects that went out of scope in batches, one batch every
# free_objects_period_milliseconds (1,000 by default). A read stream lets go of a block
# (~38 MB at 224 px) every ~0.1 s per core, so a second's worth lingered in the object store:
# a few hundred MB more of it in use, and during the first epoch every worker wrote its blocks
# into pages of it no block had used before, a page fault each (10,000 images at 224 px on
# 2 cores: ~70,000 faults per worker, ~35,000 with prompt frees). A local Ray that raying
# starts deletes each at once (its one node: a call to its own store); a cluster that raying
# starts batches them for 100 ms, as each flush is a call to every node.
FREE_PERIOD_ENV = "RAY_free_objects_period_milliseconds"
LOCAL_FREE_PERIOD_MS = 0
CLUSTER_FREE_PERIOD_MS = 100


def default_object_store_bytes(num_cpus: int | None = None) -> int | None:
    """Object store size raying gives a local Ray it starts (None: Ray's own default).

    ``Settings.object_store_mb`` (RAYING_OBJECT_STORE_MB) sets it (0: Ray's default);
    otherwise ``object_store_mb_per_cpu`` per CPU, at least ``object_store_min_mb``, at most
    30% of the node's memory (Ray's default). Read tasks keep about ``2 x CPUs`` blocks of
    ~40 MB in flight, so this leaves them several times what they use.
    """
    s = settings()
    if s.object_store_mb is not None:
        return s.object_store_mb * 2**20 if s.object_store_mb > 0 else None
    cpus = num_cpus or len(os.sched_getaffinity(0))
    want = max(s.object_store_min_mb, s.object_store_mb_per_cpu * cpus) * 2**20
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(want, 0.3 * total))


def ensure_ray(*, dashboard: bool = False) -> None:
    """Start a local Ray (or attach to RAY_ADDRESS) if this process has none yet.

    A local Ray started here gets :func:`default_object_store_bytes` of object store, and
    its workers import raying's read path as they start, and its raylet deletes blocks
    that went out of scope at once (:func:`local_ray_kwargs`). Its
    dashboard (~200 MB and ~0.6 s of start-up here) runs only with ``dashboard=True``: Ray
    Train needs it (:func:`warn_without_state_api`), reading does not.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        check_ray_address(address)
        try:
            ray.init(logging_level=logging.WARNING)
        except ConnectionError as exc:
            if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
                # Something answers at the address (check_ray_address): a head that refused
                # the token this process sent (Ray logs that only in its own warnings).
                sent = (os.environ.get("RAY_AUTH_TOKEN_PATH") or
                        ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else
                         "~/.ray/auth_token, Ray's default"))
                msg = (f"{exc} Something answers at {address}: if it is the head, it refused "
                       f"the token this process sent (from {sent}). Check that it is the "
                       f"cluster's token (`raying cluster start` keeps it in "
                       f"~/.raying/cluster/auth_token, and a head started anew makes a new "
                       f"one unless given its file)")
                raise RayConnectionError(msg) from exc
            # A head started with token auth (raying cluster start does) answers on its port
            # but refuses a driver without the token, and Ray says only that it failed.
            msg = (f"{exc} If the cluster runs with token authentication (`raying cluster "
                   f"start` starts it so), set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<the "
                   f"token file, e.g. ~/.raying/cluster/auth_token> in this environment")
            raise RayConnectionError(msg) from exc
    else:
        ray.init(address="local", include_dashboard=dashboard, log_to_driver=True,
                 logging_level=logging.WARNING,
                 object_store_memory=default_object_store_bytes(), **local_ray_kwargs())
    warm_serializer()


def warm_serializer() -> bool:
    """Make this process's Ray serialization context now, as part of starting Ray; True when
    it was made (or was there).

    Ray makes it at a process's first serialization (the first ``ray.put`` or task), and
    making it imports pydantic: ~0.1 s here, which otherwise falls inside the first epoch's
    first batch. A worker makes its own as it starts (:mod:`raying.engine.preload`).
    """
    try:
        from ray._private.worker import global_worker

        global_worker.get_serialization_context()
    except Exception:  # noqa: BLE001 - a Ray without this private helper: made on first use
        logging.getLogger(__name__).debug("no serialization context made ahead", exc_info=True)
        return False
    return True


_reader = threading.local()  # .on: this thread reads for a pipeline (see no_auto_init)


@contextlib.contextmanager
def no_auto_init() -> Iterator[None]:
    """Within it, this thread never starts a Ray of its own.

    Ray starts a local Ray on any API call made while none is up (its auto-init). A reader
    thread of a pipeline waiting on a read when the training thread calls ``ray.shutdown()``
    makes such a call inside Ray's own generator code (after its wait returns), which starts
    a new Ray from that thread, whose start later aborts the process. Here the call fails
    instead, and the pipeline reports the ended session.
    """
    _guard_auto_init()
    before = getattr(_reader, "on", False)
    _reader.on = True
    try:
        yield
    finally:
        _reader.on = before


def _guard_auto_init() -> None:
    """Wrap Ray's auto-init once so that it refuses in threads inside ``no_auto_init``."""
    try:
        from ray._private import auto_init_hook as hook
    except ImportError:  # another Ray layout: nothing to guard
        return
    original = getattr(hook, "auto_init_ray", None)
    if original is None or getattr(original, "_raying_guard", False):
        return

    def auto_init_ray() -> None:
        import ray

        if getattr(_reader, "on", False) and not ray.is_initialized():
            raise ConfigError("Ray was shut down while a pipeline read (this reader thread "
                              "does not start a new one)")
        original()

    auto_init_ray._raying_guard = True  # type: ignore[attr-defined]
    hook.auto_init_ray = auto_init_ray


def ray_session() -> str | None:
    """This process's Ray connection (:func:`raying.sampling.store.ray_session`)."""
    from raying.sampling.store import ray_session as session

    return session()


def warn_without_state_api() -> bool:
    """Warn, and return True, when the connected Ray serves no State API (no dashboard).

    Ray Train's placement-group cleaner asks the State API every second whether the
    trainer's controller is alive; without a dashboard each question fails, and the cleaner
    logs "Failed to query Ray Train Controller actor state" to the driver's console every
    second for the whole run (and could not free the trainer's resources if the controller
    died).
    """
    import ray

    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:  # noqa: BLE001 - a Ray without this private helper: say nothing
        return False
    if url:
        return False
    logging.getLogger("raying").warning(
        "this Ray runs without its dashboard, which serves the State API Ray Train uses: "
        "its placement-group cleaner will log 'Failed to query Ray Train Controller actor "
        "state' every second. Start Ray with its dashboard: ray.init() (or "
        "include_dashboard=True) before raying starts one, or `ray start` without "
        "--include-dashboard=false")
    return True


def preload_env() -> dict[str, str]:
    """The environment that has a Ray node's workers import raying's read path as they start
    (Ray's ``preload_python_modules``; see :mod:`raying.engine.preload`): for ``ray start``.
    Empty when ``RAYING_PRELOAD_WORKERS=0`` or the variable is set already (the user's)."""
    if not settings().preload_workers or os.environ.get(PRELOAD_ENV):
        return {}
    return {PRELOAD_ENV: PRELOAD_MODULE}


def cluster_env() -> dict[str, str]:
    """The environment for ``ray start`` on a node of a cluster raying starts: the read path
    preloaded in its workers (:func:`preload_env`) and objects out of scope deleted every
    ``CLUSTER_FREE_PERIOD_MS`` (unless the user's environment sets it)."""
    env = preload_env()
    if not os.environ.get(FREE_PERIOD_ENV):
        env[FREE_PERIOD_ENV] = str(CLUSTER_FREE_PERIOD_MS)
    return env


def local_ray_kwargs() -> dict[str, object]:
    """``ray.init`` arguments for a local Ray that raying starts: objects out of scope deleted
    at once (``LOCAL_FREE_PERIOD_MS``, unless the environment sets Ray's own variable), the
    read path preloaded in its workers (:func:`preload_env`)."""
    config: dict[str, object] = {}
    if not os.environ.get(FREE_PERIOD_ENV):
        config["free_objects_period_milliseconds"] = LOCAL_FREE_PERIOD_MS
    if preload_env():
        config["preload_python_modules"] = [PRELOAD_MODULE]
    return {"_system_config": config} if config else {}


def check_ray_address(address: str, timeout_s: float = DEFAULT_RAY_CONNECT_TIMEOUT_S) -> None:
    """Refuse a ``RAY_ADDRESS`` a driver cannot attach to, before ``ray.init`` waits on it.

    Raises:
        ConfigError: an ``http(s)://`` address (the job API's, for ``ray job submit``).
        RayConnectionError: (a ConnectionError) nothing accepts a connection at
            ``host:port`` (or ``ray://``'s).
    """
    if address in ("auto", "local"):
        return
    scheme, sep, rest = address.partition("://")
    if sep and scheme in ("http", "https"):
        msg = (f"RAY_ADDRESS={address} is the job API's HTTP address (what `ray job submit` "
               "takes); a driver attaches to the head's GCS address, host:port (6379 for `ray "
               "start`'s default, 6380 for `raying cluster start`'s; `ray status` on the head "
               "and `raying cluster status` print it), or to ray://host:10001. Set RAY_ADDRESS to that, or "
               "unset it to start a local Ray")
        raise ConfigError(msg)
    hostport = rest if sep else address
    host, colon, port = hostport.rpartition(":")
    if not colon or not port.isdigit():
        return  # let Ray judge forms it knows better
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                 timeout=timeout_s).close()
    except OSError as exc:
        msg = (f"could not connect to Ray at {address} (RAY_ADDRESS): {exc}. The head is down "
               "or unreachable from here: start it (raying cluster start) or unset RAY_ADDRESS "
               "to start a local Ray")
        raise RayConnectionError(msg) from None


def cpus_outside_placement_groups() -> float:
    """The cluster's CPUs less those reserved by its placement groups (created or being
    rescheduled); Ray's available CPUs where the table cannot be read."""
    import ray

    try:
        table = ray.util.placement_group_table()
    except Exception:  # noqa: BLE001 - a Ray without the table: what is free right now
        return float(ray.available_resources().get("CPU", 0.0))
    held = sum(float(bundle.get("CPU", 0.0))
               for pg in table.values() if pg.get("state") in ("CREATED", "RESCHEDULING")
               for bundle in pg.get("bundles", {}).values())
    return float(ray.cluster_resources().get("CPU", 0.0)) - held
