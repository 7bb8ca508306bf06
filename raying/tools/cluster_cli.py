"""`raying cluster start|stop|status`: the command-line side of :mod:`raying.tools.cluster`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raying.errors import ConfigError
from raying.tools.cluster import (
    DEFAULT_STATE_DIR,
    STATE_FILE,
    LocalCluster,
    load,
    logs_kept,
    start,
    status,
    stop,
)


def _read_env_file(path: str) -> dict[str, str]:
    out = {}
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        msg = f"--env-file {path}: cannot read it ({why}); give a file of KEY=VALUE lines"
        raise ConfigError(msg) from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            msg = f"{path}:{n}: expected KEY=VALUE, got a line without '=' (values not shown)"
            raise ConfigError(msg)
        out[key.strip().removeprefix("export ").strip()] = value.strip().strip("'\"")
    return out


def _resources(text: str) -> dict[str, float]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in value.items()):
        msg = (f"--resources {text!r}: expected a JSON object of names to non-negative "
               f"amounts, e.g. '{{\"trainer\": 1}}'")
        raise ConfigError(msg)
    return value


def _print_started(cluster: LocalCluster, state_dir: str | None = None) -> None:
    print(f"head:       {cluster.address}  (ray.init(address=...) needs the env below)")
    print(f"dashboard:  {cluster.dashboard_url}  (127.0.0.1 only; token auth on)")
    try:
        mode = Path(cluster.token_file).stat().st_mode & 0o777
    except OSError:
        mode = None
    shown = f"mode {mode:04o}" if mode is not None else "mode unknown"
    print(f"token file: {cluster.token_file}  ({shown}; never paste it into a job)")
    if mode is not None and mode & 0o077:
        # A token file given with --token-file is used as it is (Ray's own ~/.ray/auth_token
        # may be 0644): say so rather than print the mode raying creates its own with.
        print(f"warning:    others on this machine can read the token: chmod 600 "
              f"{cluster.token_file}")
    print("submit a job:")
    print(f"  {cluster.submit_command()}")
    print("from Python:")
    print(f"  JobSubmissionClient({cluster.dashboard_url!r}, headers={{'Authorization': "
          f"'Bearer ' + open({cluster.token_file!r}).read().strip()}})")
    where = f" --state-dir {state_dir}" if state_dir else ""
    print(f"stop it:     raying cluster stop{where}")


def main(ns: Any) -> int:
    """`raying cluster start|stop|status` (see raying.tools.cli)."""
    state_dir = getattr(ns, "state_dir", None) or DEFAULT_STATE_DIR
    if Path(state_dir).expanduser().exists() and not Path(state_dir).expanduser().is_dir():
        msg = f"--state-dir {state_dir} is a file; give a folder (it holds the head's state)"
        raise ConfigError(msg)
    if ns.action == "start":
        env = _read_env_file(ns.env_file) if getattr(ns, "env_file", None) else None
        resources = _resources(ns.resources) if getattr(ns, "resources", None) else None
        cluster = start(port=ns.port, dashboard_port=ns.dashboard_port, num_cpus=ns.num_cpus,
                        resources=resources, token_file=ns.token_file, state_dir=state_dir,
                        env=env)
        _print_started(cluster, getattr(ns, "state_dir", None))
        return 0
    if ns.action == "stop":
        if not (Path(state_dir).expanduser() / STATE_FILE).exists():
            # Stopping what is not running is done (as `ray stop`): a script may stop twice.
            print(f"no local head recorded in {state_dir}: nothing to stop")
            return 0
        cluster = load(state_dir)
        left = stop(cluster)
        print(f"stopped the head at {cluster.address}"
              + (f" ({left} of its processes outlived `ray start` and were stopped)"
                 if left else ""))
        kept = logs_kept(cluster)
        if kept.is_dir():
            print(f"its session's logs (Ray's, the jobs' drivers'): {kept}")
        return 0
    info = status(state_dir)
    for k, v in info.items():
        print(f"{k:>10}: {v}")
    return 0 if info["running"] else 1
