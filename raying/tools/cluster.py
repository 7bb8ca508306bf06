"""`raying cluster`: a local Ray head with token authentication, started and stopped by its own.

Ray 2.60 serves the job API (``ray job submit``) to anyone who can reach the dashboard port
unless token authentication is on. ``start`` turns it on for one head::

    raying cluster start  ->  token file (0600)  ->  ray start --head --block  (own session)
                              RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=<token file>,
                              dashboard on 127.0.0.1, free ports, a marker in every process' env
    raying cluster stop   ->  SIGTERM to that `ray start`, then every process carrying the
                              marker (job drivers included); SIGKILL after a grace period

``ray stop`` would stop every Ray process of the machine (other users' clusters too); ``stop``
here touches only the processes of the head it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from raying.engine.ray_setup import cluster_env
from raying.errors import RayingError
from raying.read.cache.pids import alive as pid_alive

DEFAULT_CLUSTER_PORT = 6380
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_STATE_DIR = "~/.raying/cluster"
# How long `start` waits for the head's job API to answer.
DEFAULT_START_TIMEOUT_S = 90.0
# How long `stop` waits after SIGTERM before it sends SIGKILL.
DEFAULT_STOP_GRACE_S = 10.0
# Every process of a head started here carries this variable: `stop` finds them by it.
MARKER_ENV = "RAYING_CLUSTER_ID"
STATE_FILE = "cluster.json"
_HEALTH_PATH = "/api/gcs_healthz"  # public: answers without a token
_HEALTH_PATH_AGENT = "/api/healthz"  # the head's dashboard agent, which runs submitted jobs
_START_DONE = "will now block forever"  # what `ray start --block` prints once the node is up
# Processes left once `ray start` has exited are orphans of a dead head: SIGKILL them sooner.
DEFAULT_STRAGGLER_GRACE_S = 3.0
# `ray start` attempts before `start` gives up.
DEFAULT_START_ATTEMPTS = 2
_VERSION_PATH = "/api/version"  # needs the token when auth is on


class ClusterError(RayingError, RuntimeError):
    """The local head did not start, or its state cannot be read."""


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """A running local head; everything a client needs except the token itself.

    Attributes:
        address: the GCS address (``127.0.0.1:port``), for ``ray.init(address=...)``.
        dashboard_url: the job API (``ray job submit --address ...``).
        token_file: where the auth token is kept (mode 0600).
        state_dir: folder with the state file and the head's log.
        temp_dir: the head's Ray temp dir (sessions, logs).
        pid: process id of the ``ray start --block`` that owns the head.
        cluster_id: the marker value in every process of this head.
    """

    address: str
    dashboard_url: str
    token_file: str
    state_dir: str
    temp_dir: str
    pid: int
    cluster_id: str

    def client_env(self) -> dict[str, str]:
        """Environment for Ray clients (``ray job submit``, ``ray.init``) to send the token."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_file}

    def auth_headers(self) -> dict[str, str]:
        """HTTP headers for ``JobSubmissionClient(url, headers=...)``."""
        token = Path(self.token_file).read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def job_client(self):
        """A ``JobSubmissionClient`` that sends the token."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url, headers=self.auth_headers())

    def submit_command(self, entrypoint: str = "python jobs/train_torch.py --smoke-test") -> str:
        """The exact shell command that submits ``entrypoint`` to this head."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.client_env().items())
        # `ray` as the shell finds it, else the one beside this Python (a virtualenv's bin,
        # not on PATH when raying runs as .venv/bin/raying).
        ray_bin = "ray"
        if shutil.which("ray") is None:
            ray_bin = shlex.quote(shutil.which("ray", path=os.path.dirname(sys.executable))
                                  or "ray")
        return (f"{env} {ray_bin} job submit --address {self.dashboard_url} --working-dir . "
                f"-- {entrypoint}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    """No socket holds TCP ``port`` on any IPv4 or IPv6 address (the GCS binds them all);
    connections in TIME_WAIT do not count."""
    families = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 disabled
                return False
    return True


def _ensure_token(path: Path) -> None:
    if path.exists() and path.read_text().strip():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes


def _http_status(url: str, headers: Mapping[str, str] | None = None) -> int | None:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:  # noqa: S310 - local URL
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


@contextlib.contextmanager
def _start_lock(state: Path) -> Iterator[None]:
    import fcntl

    with open(state / ".start.lock", "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            msg = (f"another `raying cluster start` from {state} is starting its head now; "
                   f"wait for it (`raying cluster status`) or use another --state-dir")
            raise ClusterError(msg) from None
        yield  # the lock goes with the file's close


def _state_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir).expanduser() / STATE_FILE


def load(state_dir: str | os.PathLike = DEFAULT_STATE_DIR) -> LocalCluster:
    """The head recorded in ``state_dir`` (it may have died since)."""
    path = _state_path(state_dir)
    if not path.exists():
        msg = (f"no local head recorded in {path.parent}; start one with `raying cluster "
               f"start`")
        raise ClusterError(msg)
    return LocalCluster(**json.loads(path.read_text()))


def start(*, port: int = DEFAULT_CLUSTER_PORT, dashboard_port: int = DEFAULT_DASHBOARD_PORT,
          num_cpus: int | None = None, resources: Mapping[str, float] | None = None,
          labels: Mapping[str, str] | None = None, token_file: str | None = None,
          state_dir: str | os.PathLike = DEFAULT_STATE_DIR,
          env: Mapping[str, str] | None = None,
          timeout_s: float = DEFAULT_START_TIMEOUT_S) -> LocalCluster:
    """Start a local head with token auth and wait until its job API answers.

    Args:
        port: GCS port; 0 picks a free one.
        dashboard_port: dashboard / job API port on 127.0.0.1; 0 picks a free one.
        num_cpus: logical CPUs of the head; None lets Ray count them.
        resources: custom resources, e.g. ``{"trainer": 1}``.
        labels: node labels, e.g. ``{"raying/role": "head"}``.
        token_file: the token; created (0600) if missing. Default ``<state_dir>/auth_token``.
        state_dir: where the state file, token and log go.
        env: extra environment for every process of the head (secrets the jobs need, on the
            cluster rather than in job submissions; never printed).
        timeout_s: how long to wait for the job API.
    """
    state = Path(state_dir).expanduser().resolve()
    state.mkdir(parents=True, exist_ok=True)
    # One start per state dir at a time: two at once would both find no head, both start
    # one, and the second's state file would hide the first head (left running).
    with _start_lock(state):
        if _state_path(state).exists():
            old = load(state)
            if _head_alive(old):
                msg = (f"a head started from {state} is running ({old.dashboard_url}, pid "
                       f"{old.pid}); stop it with `raying cluster stop` or use another state dir")
                raise ClusterError(msg)
            # A head that died (killed, its machine's OOM killer) leaves its agents, workers and
            # temp dir behind: stop those before the state file that finds them is replaced.
            stop(old, state_dir=state)
        token = Path(token_file).expanduser().resolve() if token_file else state / "auth_token"
        _ensure_token(token)
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
        if ray_bin is None:
            msg = "the `ray` command is not on PATH; install it with pip install 'ray[default]'"
            raise ClusterError(msg)
        child_env = {k: v for k, v in os.environ.items()
                     if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
        # Entrypoints' `python` is the interpreter (and venv) this head runs on.
        child_env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable),
                                             child_env.get("PATH", os.defpath)])
        # Workers import raying's read path as they start, not in their first read task;
        # blocks out of scope leave the object store within 100 ms, not a second.
        child_env.update(cluster_env())
        child_env.update(env or {})
        child_env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        extra = []
        if num_cpus is not None:
            extra.append(f"--num-cpus={int(num_cpus)}")
        if resources:
            extra.append(f"--resources={json.dumps(dict(resources))}")
        if labels:
            extra.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        for given, option in ((port, "--port"), (dashboard_port, "--dashboard-port")):
            if given and not _port_free(given):
                msg = (f"port {given} is in use (another Ray head, or `raying cluster start` "
                       f"with another --state-dir?); pass {option} 0 to pick a free one, or stop "
                       f"what holds it")
                raise ClusterError(msg)
        # `ray start` gives its raylet a fixed 30 s to register; a loaded machine can miss that.
        for attempt in range(1, DEFAULT_START_ATTEMPTS + 1):
            try:
                return _start_once(ray_bin, state, token, port, dashboard_port, extra, child_env,
                                   timeout_s)
            except ClusterError:
                if attempt == DEFAULT_START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover


# The TMPDIR of whoever started a head (empty: none), for its jobs' drivers to write their
# outputs where the caller would (not into the head's temp dir, removed at stop).
HEAD_TMPDIR_ENV = "RAYING_CALLER_TMPDIR"


def _start_once(ray_bin: str, state: Path, token: Path, port: int, dashboard_port: int,
                extra: list[str], env: dict[str, str], timeout_s: float) -> LocalCluster:
    port = port or free_port()
    dashboard_port = dashboard_port or free_port()
    agent_port = free_port()
    # Short: Ray's unix socket paths under the session dir must stay below 108 characters.
    temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp" if os.path.isdir("/tmp") else None)
    cluster_id = uuid.uuid4().hex
    cmd = [ray_bin, "start", "--head", "--block", f"--port={port}",
           "--node-ip-address=127.0.0.1", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats",
           # Every port of its own, so this head coexists with other local clusters.
           f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
           f"--object-manager-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--dashboard-agent-listen-port={agent_port}",
           f"--dashboard-agent-grpc-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", *extra]
    with open(state / "head.log", "wb") as log:
        # RAY_ADDRESS: Ray's own helpers in this head's actors (Ray Train's placement-group
        # cleaner, the state API) find this cluster, not another one on the machine.
        # TMPDIR: what the head's processes (its dashboard's multiprocessing helpers, which
        # its stop may kill before they clean up) put in the temp folder goes into its own,
        # removed at stop. The jobs' drivers take the caller's back (HEAD_TMPDIR_ENV).
        proc = subprocess.Popen(cmd, env={**env, MARKER_ENV: cluster_id, "TMPDIR": temp_dir,
                                          HEAD_TMPDIR_ENV: os.environ.get("TMPDIR", ""),
                                          "RAY_ADDRESS": f"127.0.0.1:{port}"}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    cluster = LocalCluster(address=f"127.0.0.1:{port}",
                           dashboard_url=f"http://127.0.0.1:{dashboard_port}",
                           token_file=str(token), state_dir=str(state), temp_dir=temp_dir,
                           pid=proc.pid, cluster_id=cluster_id)
    _state_path(state).write_text(json.dumps(dataclasses.asdict(cluster), indent=2))
    try:
        _wait_ready(cluster, proc, f"http://127.0.0.1:{agent_port}", timeout_s)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _wait_ready(cluster: LocalCluster, proc: subprocess.Popen, agent_url: str,
                timeout_s: float) -> None:
    """Until `ray start` finished, the job API takes the token and the job agent is up."""
    deadline = time.monotonic() + timeout_s
    headers = cluster.auth_headers()
    log = Path(cluster.state_dir) / "head.log"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            msg = f"`ray start --head` exited with code {proc.returncode}:\n{tail}"
            raise ClusterError(msg)
        if (_START_DONE in log.read_text(errors="replace")
                and _http_status(cluster.dashboard_url + _VERSION_PATH, headers) == 200
                and _http_status(agent_url + _HEALTH_PATH_AGENT) == 200):
            return
        time.sleep(0.5)
    msg = (f"the head's job API ({cluster.dashboard_url}) did not answer within {timeout_s:g} "
           f"s; see {cluster.state_dir}/head.log")
    raise ClusterError(msg)


def _has_marker(pid: int, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in environ.split(b"\0")


def marked_pids(cluster_id: str) -> list[int]:
    """Processes whose environment carries this head's marker (Linux ``/proc``)."""
    needle = f"{MARKER_ENV}={cluster_id}".encode()
    return [int(e.name) for e in Path("/proc").glob("[0-9]*")
            if int(e.name) != os.getpid() and _has_marker(int(e.name), needle)
            and pid_alive(int(e.name))]


def _head_alive(cluster: LocalCluster) -> bool:
    """The recorded `ray start` is alive and is ours (its pid may have been reused)."""
    needle = f"{MARKER_ENV}={cluster.cluster_id}".encode()
    return pid_alive(cluster.pid) and _has_marker(cluster.pid, needle)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(cluster_id: str, grace_s: float) -> list[int]:
    deadline = time.monotonic() + grace_s
    left = marked_pids(cluster_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_pids(cluster_id)
    return left


def _descendants(pid: int) -> list[Any]:
    """The processes under ``pid`` now (psutil handles: a reused pid is not taken for one)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _ancestors() -> list[Any]:
    import psutil

    try:
        return psutil.Process().parents()
    except psutil.Error:
        return []


def _running(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_procs(procs: list[Any], sig: int) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)  # checks the process is still the one listed


def _wait_procs(procs: list[Any], grace_s: float) -> list[Any]:
    """Wait up to ``grace_s`` for ``procs`` to end; returns those still running."""
    deadline = time.monotonic() + grace_s
    left = [p for p in procs if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _running(p)]
    return left


def stop(cluster: LocalCluster | None = None, *,
         state_dir: str | os.PathLike = DEFAULT_STATE_DIR,
         grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
    """Stop the head and every process it started; returns how many outlived `ray start`.

    Only processes of this head are signalled: those carrying its marker, and those under it
    when the stop began (never the caller or its parents); ``ray stop`` is never used,
    because it stops every Ray process of the machine.
    """
    cluster = cluster or load(state_dir)
    tree: list[Any] = []
    if _head_alive(cluster):  # `ray start --block` stops its node's processes on SIGTERM
        # Its process tree as it is now, besides the markers: a process that rewrites its
        # title (Ray's agents) may overwrite the environment /proc shows, marker included.
        tree = _descendants(cluster.pid)
        _signal_all([cluster.pid], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pid_alive(cluster.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    stragglers = marked_pids(cluster.cluster_id)  # workers, job drivers (own sessions)
    # Never this process or the ones it runs under (a job's entrypoint may stop its head).
    spared = {os.getpid(), *(p.pid for p in _ancestors())}
    unmarked = [p for p in tree if p.pid not in stragglers and p.pid not in spared
                and _running(p)]
    _signal_all(stragglers, signal.SIGTERM)
    _signal_procs(unmarked, signal.SIGTERM)
    straggler_grace = min(grace_s, DEFAULT_STRAGGLER_GRACE_S)
    _signal_all(_wait_gone(cluster.cluster_id, straggler_grace), signal.SIGKILL)
    _signal_procs(_wait_procs(unmarked, straggler_grace), signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(cluster.pid, os.WNOHANG)  # reap it when this process started it
    _wait_gone(cluster.cluster_id, grace_s)
    _wait_procs(unmarked, grace_s)
    stragglers = stragglers + [p.pid for p in unmarked]
    keep_logs(cluster)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        _state_path(cluster.state_dir).unlink()
    return len(stragglers)


def logs_kept(cluster: LocalCluster) -> Path:
    """Where :func:`stop` keeps the last session's logs (Ray's, the jobs' drivers')."""
    return Path(cluster.state_dir).expanduser() / "last-session-logs"


def keep_logs(cluster: LocalCluster) -> None:
    """Move the head's session logs out of its temp dir before it is removed, replacing the
    ones kept before: a job that failed can still be looked into after the stop."""
    logs = Path(cluster.temp_dir) / "session_latest" / "logs"
    if not logs.is_dir():
        return
    kept = logs_kept(cluster)
    shutil.rmtree(kept, ignore_errors=True)
    with contextlib.suppress(OSError):
        shutil.move(str(logs.resolve()), str(kept))
        # Ray makes its log folders world-writable under /tmp; kept beside the token, only
        # their owner reads them (a job's driver log holds what the job printed).
        kept.chmod(0o700)


def status(state_dir: str | os.PathLike = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """What the recorded head looks like now: alive, healthy, address, processes."""
    cluster = load(state_dir)
    alive = _head_alive(cluster)
    healthy = alive and _http_status(cluster.dashboard_url + _HEALTH_PATH) == 200
    return {"running": bool(alive), "healthy": bool(healthy), "address": cluster.address,
            "dashboard": cluster.dashboard_url, "token_file": cluster.token_file,
            "pid": cluster.pid, "processes": len(marked_pids(cluster.cluster_id)),
            "submit": cluster.submit_command()}
