"""What the Ray job entrypoints share: config files, smoke data, secrets hygiene, the summary."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from raying.tools.cli import positive_int

# The line a job prints last; tests and log scrapers find the run's summary by it.
SUMMARY_PREFIX = "RAYING_SUMMARY "
# Smoke-test dataset: small enough for seconds on one CPU, big enough for several blocks.
SMOKE_IMAGES = 96
SMOKE_CLASSES = 3
SMOKE_SOURCE_PX = (40, 48)
# Ids per epoch above which workers send counts instead of their ids to the run ledger.
MAX_LEDGER_IDS = 1_000_000
# Variables that hold credentials: their presence is reported, their values never.
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
CREDENTIAL_FILE_ENV = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE")


def run(main: Callable[[], int | None],
        parser: argparse.ArgumentParser | None = None) -> int:
    """A job's entry point: raying's own errors (a missing path, bad data, refused
    credentials) are one line on stderr and exit code 2, not a traceback; also where a Ray
    Train worker raised them (Ray Train's own error cuts the worker's message short). With
    the job's ``parser``, the fixes they name in keywords (``overwrite=True``) are said in
    the job's flags (``--overwrite``)."""
    from raying.errors import RayingError
    from raying.tools.cli import _in_flags

    try:
        return int(main() or 0)
    except RayingError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {type(exc).__name__}: "
              f"{_in_flags(str(exc), parser)}", file=sys.stderr)
        return 2
    except Exception as exc:
        found = raying_error_in(exc)
        if found is None or found[0] is None:  # not raised in a Train worker: as it is
            raise
        rank, err = found
        print(f"{Path(sys.argv[0]).name}: error: {type(err).__name__} in Train worker {rank}: "
              f"{_in_flags(str(err), parser)}", file=sys.stderr)
        return 2


def raying_error_in(exc: BaseException) -> tuple[int | None, BaseException] | None:
    """(worker rank or None, raying error) found inside ``exc``: a Ray Train error's worker
    failures (each wrapping the worker's exception), a Ray task error's cause, an exception's
    explicit cause (``raise ... from``; not the one being handled when it was raised, which
    would hide a bug behind it); None when raying raised none of them."""
    from raying.errors import RayingError

    todo: list[tuple[int | None, BaseException]] = [(None, exc)]
    seen: set[int] = set()
    while todo:
        rank, e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayingError):
            return rank, e
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo.extend((int(r) if isinstance(r, int) else None, f)
                        for r, f in failures.items() if isinstance(f, BaseException))
        for name in ("_base_exc", "cause", "controller_failure", "__cause__"):
            inner = getattr(e, name, None)
            if isinstance(inner, BaseException):
                todo.append((rank, inner))
    return None


positive = positive_int  # argparse type: an integer of 1 or more


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Arguments every job takes."""
    p.add_argument("--config", metavar="FILE",
                   help="JSON or YAML file of argument values (keys as the long options, "
                        "e.g. batch_size); options given on the command line win")
    p.add_argument("--smoke-test", action="store_true",
                   help="a seconds-long run on generated data (no --data needed)")
    p.add_argument("--data", metavar="URI",
                   help="dataset: image folder or Parquet (path, s3://, hdfs://); on a "
                        "multi-node cluster it must be storage every node reaches")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (credentials come from the "
                                          "nodes' AWS environment, never from arguments)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as indented JSON")
    p.set_defaults(_needs_data=True)  # checked by parse_args, before Ray starts


def load_config(path: str) -> dict[str, Any]:
    """A dict of argument values from a JSON or YAML file."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        msg = f"config file {path}: cannot read it ({exc.strerror or exc}); check the path"
        raise SystemExit(msg) from None
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        if is_yaml:
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - json.JSONDecodeError, yaml.YAMLError
        msg = f"config file {path} is not valid {'YAML' if is_yaml else 'JSON'}: {exc}"
        raise SystemExit(msg) from None
    if not isinstance(data, dict):
        msg = f"config file {path} must hold a mapping of option names to values, got {type(data).__name__}"
        raise SystemExit(msg)
    return data


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; values of ``--config FILE`` become defaults the command line overrides."""
    caller_tmpdir()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        values = {k.replace("-", "_"): v for k, v in load_config(known.config).items()}
        dests = {a.dest for a in p._actions} - {"help", "config"}
        unknown = sorted(set(values) - dests)
        if unknown:
            p.error(f"config file {known.config}: unknown keys {unknown}; expected some of "
                    f"{sorted(dests)}")
        p.set_defaults(**values)
    args = p.parse_args(argv)
    for action in p._actions:  # values from --config skip argparse's checks of choices too
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            p.error(f"argument {action.option_strings[0]}: invalid choice: {value!r} (choose "
                    f"from {', '.join(map(repr, action.choices))})")
    for action in p._actions:  # values from --config skip argparse's type conversion
        value = getattr(args, action.dest, None)
        if action.type is positive and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            p.error(f"argument {action.option_strings[0]}: {value!r}: must be an integer of "
                    f"1 or more")
    for action in p._actions:  # a switch from --config: "false" would be truthy
        value = getattr(args, action.dest, None)
        if action.nargs == 0 and action.dest != "help" and not isinstance(value, bool):
            p.error(f"argument {action.option_strings[0]}: {value!r}: a switch takes true or "
                    f"false (JSON booleans) in a config file")
    failures = getattr(args, "max_failures", None)
    if failures is not None and (isinstance(failures, bool) or not isinstance(failures, int)
                                 or failures < -1):
        p.error(f"argument --max-failures: {failures!r}: must be -1 (retry for ever), 0 or "
                f"more")
    for name in ("cpus_per_worker", "lr"):  # here, not as Ray Train's controller error
        value = getattr(args, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            p.error(f"argument --{name.replace('_', '-')}: {value!r}: must be a finite number "
                    f"above 0")
    if getattr(args, "_needs_data", False) and not args.data and not args.smoke_test:
        # here, not after Ray has started (seconds later)
        p.error("--data URI is required (or --smoke-test for generated data)")
    return args


def smoke_data(n: int = SMOKE_IMAGES) -> str:
    """Generate the smoke-test image folder (deterministic) in a temp dir; returns its path."""
    from raying.tools.datagen import make_image_folder

    root = Path(tempfile.gettempdir()) / f"raying-smoke-{n}-{os.getuid()}"
    done = root / ".complete"
    if not done.exists():
        make_image_folder(root, n=n, classes=SMOKE_CLASSES, size=SMOKE_SOURCE_PX, seed=7)
        done.write_text("ok")
    return str(root)


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """Non-secret storage settings from the arguments; secrets stay in the environment."""
    opts = {k: getattr(args, k) for k in ("endpoint_url", "region") if getattr(args, k, None)}
    return opts or None


def kept_output(path: Any, flag: str) -> Any:
    """An output path the job's caller will find. A relative one resolves against the
    driver's working directory, which under ``ray job submit --working-dir`` is Ray's copy
    of it, under the head's temp dir (gone with the cluster): refused there, naming the
    flag. Absolute paths, URIs and None pass."""
    if path is None or "://" in str(path) or os.path.isabs(str(path)):
        return path
    cwd = os.getcwd()
    if "/runtime_resources/working_dir_files/" in cwd + "/":
        msg = (f"{flag} {str(path)!r} is a relative path, and this job runs in Ray's copy of "
               f"its working directory ({cwd}), which goes with the cluster: pass an "
               f"absolute path or a URI")
        raise SystemExit(msg)
    return path


def in_job_copy() -> bool:
    """Whether this driver runs in Ray's copy of a submitted job's working directory."""
    return "/runtime_resources/working_dir_files/" in os.getcwd() + "/"


def caller_tmpdir() -> None:
    """A job driver on a head started by ``raying cluster start`` writes its temp files (the
    default outputs, the generated smoke data) where the head's caller would, not into the
    head's own temp dir, which its stop removes."""
    from raying.tools.cluster import HEAD_TMPDIR_ENV

    if HEAD_TMPDIR_ENV not in os.environ:
        return
    original = os.environ.pop(HEAD_TMPDIR_ENV)
    if original:
        os.environ["TMPDIR"] = original
    else:
        os.environ.pop("TMPDIR", None)
    tempfile.tempdir = None  # gettempdir() looks again


def room_for_reads(args: Any, task_cpus: float = 1.0) -> None:
    """On one node, leave the read tasks a CPU beside the Train workers: workers that take
    every CPU leave the reads, and so the run, waiting for ever. ``--cpus-per-worker`` left
    to its default shrinks to what fits (said on stderr); one given that does not fit stops
    a one-machine run (no ``--storage-path``) with the fix. CPUs other runs' Train workers
    hold count as taken: two runs whose workers each leave the other's reads no CPU would
    wait on each other for ever. Where the workers do not fit this node at all, or there are
    several nodes, or ``--storage-path`` says other nodes may come (an autoscaling cluster),
    what fits is not known here: raying.train warns once the workers hold their CPUs, and
    :func:`train_storage` asks for shared storage."""
    import ray

    from raying.engine.ray_setup import cpus_outside_placement_groups

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) != 1:
        return
    total = float(nodes[0].get("Resources", {}).get("CPU", 0.0))
    # Other jobs' Train workers hold theirs in placement groups: what is left is this run's.
    cpus = min(total, cpus_outside_placement_groups())
    held = f" ({total - cpus:g} of its {total:g} held by other runs)" if cpus < total else ""
    workers = args.num_workers * args.cpus_per_worker
    if workers > total:
        return
    if total - workers >= task_cpus and (workers > cpus or cpus - workers >= task_cpus):
        # It fits on its own: its workers wait for CPUs other runs hold (reserving none
        # meanwhile), or get them with a CPU left for the reads.
        return
    fits = math.floor((cpus - task_cpus) / args.num_workers * 20) / 20  # 0.05 steps
    if getattr(args, "cpus_auto", False) and fits >= 0.05:
        print(f"this node has {cpus:g} CPUs free{held}: each of the {args.num_workers} Train "
              f"workers takes "
              f"{fits:g} (not {args.cpus_per_worker:g}), leaving "
              f"{cpus - fits * args.num_workers:g} for the read tasks", file=sys.stderr)
        args.cpus_per_worker = fits
        return
    if getattr(args, "storage_path", None):
        return
    fix = (f"pass --cpus-per-worker {fits:g} or less" if fits >= 0.05 else
           "pass fewer --num-workers, or run on a node with more CPUs" if not held else
           "wait for the other runs to end, or run on a node with more CPUs")
    msg = (f"the {args.num_workers} Train workers take {workers:g} of this node's {cpus:g} "
           f"free CPUs{held}, leaving {max(cpus - workers, 0):g} for the read tasks, which need "
           f"{task_cpus:g} each: the reads, and the run, would wait for ever; {fix}")
    raise SystemExit(msg)


def train_storage(storage_path: str | None, workers: dict[str, float] | None = None) -> str:
    """Where Ray Train keeps the run's state and checkpoints: ``--storage-path``, else a local
    folder, which only a one-node cluster can use. On several nodes Ray Train refuses a local
    path at the first checkpoint of a worker on another node, after the epoch's work: say so
    now, with the fix. ``workers``: what the Train workers need together; a driver's node
    that lacks it (an autoscaling cluster whose trainer nodes are not up yet, a head with no
    CPU or GPU) will see them run elsewhere."""
    import ray

    if storage_path:
        return kept_output(storage_path, "--storage-path")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    own = next((n.get("Resources", {}) for n in nodes if n.get("NodeID") == here), {})
    short = sorted(k for k, v in (workers or {}).items() if v > own.get(k, 0.0))
    fix = ("pass --storage-path (s3://bucket/runs, or a shared file system's path)")
    if len(nodes) > 1:
        msg = (f"this cluster has {len(nodes)} nodes, and Ray Train's checkpoints must go "
               f"where every node reaches them: {fix}")
        raise SystemExit(msg)
    if short:
        need = ", ".join(f"{k} {workers[k]:g} (this node has {own.get(k, 0.0):g})"  # type: ignore[index]
                         for k in short)
        msg = (f"the Train workers need {need}: on an autoscaling cluster they will run on "
               f"nodes yet to come, and Ray Train's checkpoints must go where every node "
               f"reaches them: {fix}; on one machine, ask for less (--num-workers, "
               f"--cpus-per-worker)")
        raise SystemExit(msg)
    return os.path.join(tempfile.gettempdir(), "raying-train")


def credentials_source() -> str:
    """Where storage credentials come from on this node, by name only (never the values)."""
    env = [k for k in CREDENTIAL_ENV if os.environ.get(k)]
    files = [k for k in CREDENTIAL_FILE_ENV if os.environ.get(k)]
    parts = []
    if env:
        parts.append("environment: " + ", ".join(env))
    if files:
        parts.append("files/profile: " + ", ".join(files))
    if not parts:
        return "none on this node (the AWS default chain: ~/.aws, instance role)"
    return "; ".join(parts) + " (values not shown)"


def manifest(args: argparse.Namespace):
    """The run's manifest: ``--data``, or generated smoke data."""
    import raying

    uri = args.data
    if uri is None:
        if not args.smoke_test:
            raise SystemExit("--data URI is required (or --smoke-test for generated data)")
        uri = smoke_data()
    return raying.Manifest.scan(uri, storage=storage_options(args))


def worker_reads(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the Train workers' reads did, from each worker's latest ledger record (its
    pipeline's stats are totals since the worker started)."""
    latest: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("rows_by_node") is not None and r["epoch"] >= latest.get(
                r["rank"], {"epoch": -1})["epoch"]:
            latest[int(r["rank"])] = r
    by_node: dict[str, int] = {}
    skipped: dict[int, dict[str, Any]] = {}
    for r in latest.values():
        for node, rows in r["rows_by_node"].items():
            by_node[node] = by_node.get(node, 0) + rows
        skipped.update({int(s["id"]): s for s in r["skipped"]})
    reasons: dict[str, int] = {}
    for s in skipped.values():
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    return {"rows_by_node": by_node, "skipped_count": len(skipped),
            "skipped_by_reason": reasons,
            "read_retries": sum(r["read_retries"] for r in latest.values())}


def ledger_actor():
    """A tiny actor the Train workers send their per-epoch records to (ids, rows, losses)."""
    import ray

    @ray.remote(num_cpus=0)
    class RunLedger:
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def add(self, record: dict[str, Any]) -> None:
            self.records.append(record)

        def all(self) -> list[dict[str, Any]]:
            return self.records

    return RunLedger.remote()


def epoch_coverage(records: list[dict[str, Any]], n: int) -> dict[int, dict[str, Any]]:
    """Per epoch: rows over all workers and whether every id came exactly once.

    A worker group that Ray Train restarted (``max_failures``) reads again the epochs after
    the checkpoint it restored, whole, in new processes: of each rank's records of an epoch
    (``records`` in the order they arrived) those of its last ``attempt`` (the worker
    process's run) count, and ``reread`` says how many of earlier attempts they replaced. Two
    records of one rank, epoch and attempt are both counted: a double read, not a restart.
    """
    out: dict[int, dict[str, Any]] = {}
    for epoch in sorted({r["epoch"] for r in records}):
        every = [r for r in records if r["epoch"] == epoch]
        last_attempt = {int(r["rank"]): r.get("attempt") for r in every}
        mine = [r for r in every if r.get("attempt") == last_attempt[int(r["rank"])]]
        rows = sum(r["rows"] for r in mine)
        entry: dict[str, Any] = {"rows": rows, "workers": len(last_attempt),
                                 "reread": len(every) - len(mine),
                                 "rows_by_rank": {rank: sum(r["rows"] for r in mine
                                                            if int(r["rank"]) == rank)
                                                  for rank in sorted(last_attempt)},
                                 "loss": sum(r["loss_sum"] for r in mine) / max(rows, 1)}
        if all(r.get("ids") is not None for r in mine):
            ids = np.concatenate([np.asarray(r["ids"], np.int64) for r in mine] or
                                 [np.zeros(0, np.int64)])
            counts = np.bincount(ids, minlength=n) if ids.size else np.zeros(n, np.int64)
            entry.update(unique=int((counts > 0).sum()), repeated=int((counts > 1).sum()),
                         missing=int((counts == 0).sum()),
                         exactly_once=bool(ids.size == n and (counts == 1).all()))
        out[int(epoch)] = entry
    return out


def store_summary(handle: Any) -> dict[str, Any]:
    """The priority store's health, the figures a run summary shows."""
    from raying.sampling import store as st

    s = st.stats(handle)
    return {"name": s["name"], "n": s["n"], "shards": s["shards"],
            "updates_received": s["updates_received"], "updates_applied": s["updates_applied"],
            "rejected": sum(s["rejected"].values()), "pending": s["pending"],
            "ess_fraction": round(s["ess_fraction"], 4),
            "never_updated_share": round(s["age"]["never_updated_share"], 4),
            "snapshots": s["snapshots"]}


def emit_summary(title: str, summary: dict[str, Any], *, as_json: bool = False) -> None:
    """Print the summary for people, then one machine-readable line (``SUMMARY_PREFIX``)."""
    if as_json:
        print(json.dumps(summary, indent=2, default=_plain))
    else:
        print(f"== {title} ==")
        for key, value in summary.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    print(f"  {k}: {json.dumps(v, default=_plain)}")
            else:
                print(f"{key}: {json.dumps(value, default=_plain)}")
    print(SUMMARY_PREFIX + json.dumps(summary, default=_plain), flush=True)
    sys.stdout.flush()


def find_summary(text: str) -> dict[str, Any] | None:
    """The last summary line in a job's logs, parsed (None if there is none)."""
    found = None
    for line in text.splitlines():
        at = line.find(SUMMARY_PREFIX)
        if at >= 0:
            found = json.loads(line[at + len(SUMMARY_PREFIX):])
    return found


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
