"""`raying bench`: raying against the limit, torch DataLoader, tf.data and Ray Data, side by side.

The benchmark protocol (docs/benchmarks.md), in one command and one run:

1. Workloads W1-W5 are generated (or found in ``--data``), see :mod:`raying.bench.workloads`.
2. For every round, every (workload, peer) measurement runs in its own child process
   (:mod:`raying.bench.child`; ``--isolate peer`` groups a peer's workloads into one process, as
   ``--quick`` does to save start-ups), peers interleaved round-robin and rotated each round.
   The orchestrator watches each child's process tree from outside for CPU-seconds and peak
   PSS (:mod:`raying.bench.launch`, :mod:`raying.bench.measure`). Each measurement runs every (batch size, consumer mode)
   cell with a fresh loader and ``--epochs`` epochs; the first is the cold epoch.
3. Medians over rounds, ratios to the limit and to the best peer, the speed targets
   (:mod:`raying.bench.aggregate`); ``bench.json``, ``bench.png`` and a console table in
   ``--out`` (:mod:`raying.bench.report`), with one log per measurement in ``--out/logs``.

Same work for every peer: decode + random-resized-crop 224 (torchvision's ranges) + 50% flip,
uint8 NHWC out, labels included, shuffle on, every batch's rows counted and checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from typing import Any

from raying.bench import aggregate, report
from raying.bench.child import PEER_NEEDS, PEERS, REFERENCE_PEERS, TRAIN_PEERS, peer_workloads
from raying.bench.launch import Job, run_job
from raying.bench.workloads import (
    ALL_WORKLOADS,
    QUICK_W1_IMAGES,
    QUICK_W2_IMAGES,
    QUICK_W6_IMAGES,
    Sizes,
)
from raying.errors import ConfigError

ALL_PEERS = ("L", "L-crop", "pyarrow", "torch", "tf", "tf-cache", "raydata", "raying",
             "raying-cache", "raying-cache-eager", "raying-train", "raydata-train")
ALL_MODES = ("iterate", "sleep", "compute")
DEFAULT_ROUNDS = 3
DEFAULT_EPOCHS = 3  # one cold epoch, two steady ones
DEFAULT_BATCH_SIZES = (64, 256)
QUICK_EPOCHS = 2
QUICK_BATCH_SIZES = (64,)
QUICK_MODES = ("iterate", "compute")
# The consumer's per-image cost in the sleep and compute modes: 0.25 ms/image caps a consumer
# at 4,000 img/s, above what 2 cores decode, so overlap and contention both show.
DEFAULT_SLEEP_MS_PER_IMAGE = 0.25
DEFAULT_WORK_MS_PER_IMAGE = 0.25
DEFAULT_JOB_TIMEOUT_S = 1800.0
QUICK_JOB_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything one bench run does; ``config`` in the JSON."""

    quick: bool
    rounds: int
    epochs: int
    batch_sizes: tuple[int, ...]
    modes: tuple[str, ...]
    workloads: tuple[str, ...]
    peers: tuple[str, ...]
    sizes: Sizes
    cores: int
    isolate: str
    sleep_ms_per_image: float
    work_ms_per_image: float
    work_bytes_per_image: int | None
    timeout_s: float
    out: str
    data: str
    seed: int = 0


def _csv(value: str | None, allowed: tuple[str, ...], what: str, default: tuple[str, ...]):
    if not value:
        return default
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        msg = f"--{what} takes a comma list of {', '.join(allowed)}; got {value!r}"
        raise ConfigError(msg)
    return items


def _positive(name: str, value: Any) -> None:
    if value is not None and value < 1:
        msg = f"--{name} must be >= 1, got {value!r}"
        raise ConfigError(msg)


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    """The run's config from the CLI's namespace (missing attributes take the defaults)."""
    g = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    quick = bool(g("quick", False))
    for name in ("images", "rounds", "epochs", "w2_images", "w4_images", "w6_images", "cores",
                 "decode_size"):
        _positive(name.replace("_", "-"), g(name))
    epochs = g("epochs") or (QUICK_EPOCHS if quick else DEFAULT_EPOCHS)
    if epochs < 2:
        msg = f"--epochs must be >= 2 (one cold epoch, then steady ones), got {epochs}"
        raise ConfigError(msg)
    raw_batches = g("batch_sizes")
    try:
        batches = tuple(int(b) for b in str(raw_batches).split(",")) if raw_batches else (
            QUICK_BATCH_SIZES if quick else DEFAULT_BATCH_SIZES)
    except ValueError:
        msg = f"--batch-sizes takes a comma list of integers, got {g('batch_sizes')!r}"
        raise ConfigError(msg) from None
    for b in batches:
        _positive("batch-sizes", b)
    sizes = Sizes(w1=g("images") or (QUICK_W1_IMAGES if quick else Sizes.w1),
                  w2=g("w2_images") or (QUICK_W2_IMAGES if quick else Sizes.w2),
                  w4=g("w4_images"), decode_size=g("decode_size") or Sizes.decode_size,
                  w6=g("w6_images") or (QUICK_W6_IMAGES if quick else Sizes.w6))
    if sizes.decode_size < 224:
        msg = f"--decode-size must be >= 224 (W4 crops 224 from it), got {sizes.decode_size}"
        raise ConfigError(msg)
    cores = g("cores") or len(os.sched_getaffinity(0))
    isolate = g("isolate") or ("peer" if quick else "workload")
    if isolate not in ("workload", "peer"):
        msg = f"--isolate must be 'workload' or 'peer', got {isolate!r}"
        raise ConfigError(msg)
    data = g("data") or os.path.join(tempfile.gettempdir(), "raying-bench-data")
    work_kb = g("work_kb_per_image")
    return BenchConfig(
        quick=quick, rounds=g("rounds") or (1 if quick else DEFAULT_ROUNDS), epochs=epochs,
        batch_sizes=batches,
        modes=_csv(g("modes"), ALL_MODES, "modes", QUICK_MODES if quick else ALL_MODES),
        workloads=_csv(g("workloads"), ALL_WORKLOADS, "workloads", ALL_WORKLOADS),
        peers=_csv(g("peers"), ALL_PEERS, "peers", ALL_PEERS), sizes=sizes, cores=cores,
        isolate=isolate,
        sleep_ms_per_image=_at_least("sleep_ms", g("sleep_ms"), DEFAULT_SLEEP_MS_PER_IMAGE, 0),
        work_ms_per_image=_at_least("work_ms", g("work_ms"), DEFAULT_WORK_MS_PER_IMAGE, 0),
        work_bytes_per_image=(int(_at_least("work_kb_per_image", work_kb, 0, 0) * 1024)
                              if work_kb else None),
        timeout_s=_at_least("timeout", g("timeout"),
                            QUICK_JOB_TIMEOUT_S if quick else DEFAULT_JOB_TIMEOUT_S, 1e-9),
        out=g("out") or "bench-results", data=data)


def _at_least(name: str, value: Any, default: float, low: float) -> float:
    """A number option: ``default`` when not given (0 is a value, not "not given"), refused
    below ``low``."""
    if value is None:
        return float(default)
    number = float(value)
    if not math.isfinite(number) or number < low:
        bound = "above 0" if low > 0 else "0 or more"
        msg = f"--{name.replace('_', '-')} must be {bound}, got {value!r}"
        raise ConfigError(msg)
    return number


# -- the plan ------------------------------------------------------------------------------------
def plan_jobs(cfg: BenchConfig) -> list[list[Job]]:
    """Rounds of jobs: workloads in order, peers rotated by one place every round.

    W5 (raying prioritized) shares raying's W1 process and its cells alternate with W1's
    (same batch size and mode back to back), so the prioritized / uniform ratio compares
    neighbours in time rather than the two ends of a round. W1 runs first: its cold figures
    come from a fresh process, as every other peer's do.
    """

    def modes(peer: str, wl: str) -> tuple[str, ...]:
        if peer in REFERENCE_PEERS or (cfg.quick and peer in TRAIN_PEERS):
            return ("iterate",)
        if cfg.quick and wl not in (cfg.workloads[0], "W5"):  # quick: other modes on one
            return cfg.modes[:1]                               # workload only
        return cfg.modes

    def cells(peer: str, wls: tuple[str, ...]) -> list[dict[str, Any]]:
        paired = "W1" in wls and "W5" in wls
        out = []
        for w in wls:
            if w == "W5" and paired:
                continue
            for b in cfg.batch_sizes:
                for m in modes(peer, w):
                    pair = [{"workload": w, "batch_size": b, "mode": m}]
                    if w == "W1" and paired and m in modes(peer, "W5"):
                        pair.append({"workload": "W5", "batch_size": b, "mode": m})
                    out.extend(pair)
        return out

    rounds = []
    for r in range(cfg.rounds):
        peers = list(cfg.peers)
        peers = peers[r % len(peers):] + peers[:r % len(peers)]
        jobs = []
        if cfg.isolate == "peer":
            for p in peers:
                wls = tuple(w for w in cfg.workloads if w in peer_workloads(p, quick=cfg.quick))
                if wls:
                    jobs.append(Job(r, p, wls, cells(p, wls)))
        else:
            for w in cfg.workloads:
                for p in peers:
                    mine = peer_workloads(p, quick=cfg.quick)
                    if w not in mine or (w == "W5" and "W1" in cfg.workloads and "W1" in mine):
                        continue
                    wls = (w, "W5") if (w == "W1" and "W5" in cfg.workloads
                                        and "W5" in mine) else (w,)
                    jobs.append(Job(r, p, wls, cells(p, wls)))
        rounds.append(jobs)
    return rounds


def missing_peers(peers: tuple[str, ...]) -> dict[str, str]:
    """Peers whose framework is not installed here, with the command that installs it."""
    import importlib.util

    out = {}
    for p in peers:
        if p in PEER_NEEDS:
            module, fix = PEER_NEEDS[p]
            if importlib.util.find_spec(module) is None:
                out[p] = f"{module} is not installed; {fix}"
    return out


# -- host and calibration ------------------------------------------------------------------------
def calibrate_work(ms_per_image: float) -> tuple[int, float]:
    """Bytes of sha256 per image that cost ``ms_per_image`` on one core here (best of 5)."""
    buf = os.urandom(1 << 20)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(16):
            hashlib.sha256(buf).digest()
        best = min(best, time.perf_counter() - t0)
    bytes_per_s = 16 * len(buf) / best
    return int(bytes_per_s * ms_per_image / 1000), bytes_per_s


def compile_raying() -> dict[str, Any]:
    """Write the bytecode of raying's own modules, as an installed package has it.

    torch's, tf's and Ray's modules come compiled from their wheels; raying's, in an editable
    install under ``PYTHONDONTWRITEBYTECODE`` (set on this project's machines), would be
    compiled again by every Ray worker that imports its read path, inside raying's cold
    epoch and no other peer's. Python reads the files whatever that variable says.
    """
    import compileall

    import raying

    folder = os.path.dirname(os.path.abspath(raying.__file__))
    ok = compileall.compile_dir(folder, quiet=1)
    return {"raying_bytecode": "compiled" if ok else "not all modules compiled",
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}


def _host(cores: int) -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh
                          if ln.startswith("model name")), "")
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for mod in ("ray", "torch", "tensorflow", "numpy", "pyarrow", "simplejpeg", "cv2", "raying"):
        try:
            from importlib.metadata import version

            name = {"cv2": "opencv-python-headless"}.get(mod, mod)
            versions[mod] = version(name)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            versions[mod] = None
    mem = 0
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": model, "cores_used": cores, "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "mem_mb": mem,
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": versions, "loadavg_start": os.getloadavg()}


# -- main ----------------------------------------------------------------------------------------
def main(ns: argparse.Namespace) -> int:
    """Run the bench; returns 0 when every peer ran and counted its rows right, else 1."""
    from raying.bench import workloads as _w

    cfg = config_from_args(ns)
    quiet = bool(getattr(ns, "json", False))

    def say(text: str) -> None:
        print(text, file=sys.stderr if quiet else sys.stdout, flush=True)

    for flag, folder in (("--out", cfg.out), ("--data", cfg.data)):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            msg = f"{flag} {folder}: cannot create that folder ({exc.strerror}); give a folder"
            raise ConfigError(msg) from None
    logs = os.path.join(cfg.out, "logs")
    os.makedirs(logs, exist_ok=True)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t_run = time.monotonic()
    host = _host(cfg.cores)
    host.update(compile_raying())
    say(f"raying bench: {cfg.cores} cores, workloads {','.join(cfg.workloads)}, peers "
        f"{','.join(cfg.peers)}, {cfg.rounds} round(s) x {cfg.epochs} epochs, batch "
        f"{','.join(map(str, cfg.batch_sizes))}, modes {','.join(cfg.modes)}; data in {cfg.data}")
    wls = _w.prepare(list(cfg.workloads), cfg.sizes, cfg.data, say=say)
    work_bytes, sha_rate = (cfg.work_bytes_per_image, None)
    if work_bytes is None:
        work_bytes, sha_rate = calibrate_work(cfg.work_ms_per_image)
    spec_extra = {"workloads": {k: v.to_dict() for k, v in wls.items()},
                  "sleep_s_per_image": cfg.sleep_ms_per_image / 1000.0,
                  "work_bytes_per_image": work_bytes}
    missing = missing_peers(cfg.peers)
    for peer, why in missing.items():
        say(f"skipping peer {peer}: {why}")
    if missing:
        cfg = dataclasses.replace(cfg, peers=tuple(p for p in cfg.peers if p not in missing))
    rounds = plan_jobs(cfg)
    total = sum(len(r) for r in rounds)
    runs: list[dict[str, Any]] = []
    n = 0
    for jobs in rounds:
        for job in jobs:
            n += 1
            say(f"[round {job.round + 1}/{cfg.rounds} | {n}/{total}] {'+'.join(job.workloads)} "
                f"{job.peer}: {len(job.cells)} cell(s)")
            res = run_job(job, epochs=cfg.epochs, cores=cfg.cores, seed=cfg.seed,
                          timeout_s=cfg.timeout_s, spec_extra=spec_extra, logs=logs, say=say)
            start = res.get("start", {})
            if start.get("ray_start_s") is not None:
                say(f"  ray start-up {start['ray_start_s']:.1f} s (not in any ttfb)")
            runs.append(res)
            # What has run so far survives an interrupted or crashed run.
            report.write_json({"config": dataclasses.asdict(cfg), "runs": runs},
                              os.path.join(cfg.out, "bench.partial.json"))
    wl_dicts = {k: v.to_dict() for k, v in wls.items()}
    rows = aggregate.combine(runs, wl_dicts, cfg.epochs)
    checks = aggregate.targets(rows)
    doc: dict[str, Any] = {
        "version": 1, "started": started, "seconds": round(time.monotonic() - t_run, 1),
        "command": " ".join(sys.argv), "host": host,
        "config": {**dataclasses.asdict(cfg), "work_bytes_per_image": work_bytes,
                   "sha256_bytes_per_s": sha_rate},
        "definitions": aggregate.__doc__, "peers": {p: PEERS[p] for p in cfg.peers},
        "workloads": wl_dicts, "results": rows, "targets": checks, "skipped_peers": missing,
        "runs": runs,
    }
    host["loadavg_end"] = os.getloadavg()
    host["loadavg_1min_max"] = max([r["loadavg_before"][0] for r in runs]
                                   + [r["loadavg_after"][0] for r in runs], default=0.0)
    json_path = os.path.join(cfg.out, "bench.json")
    png_path = os.path.join(cfg.out, "bench.png")
    report.write_json(doc, json_path)
    partial = os.path.join(cfg.out, "bench.partial.json")
    if os.path.exists(partial):
        os.remove(partial)
    report.chart(rows, png_path, f"raying bench, {cfg.cores} cores, {started}, median of "
                                 f"{cfg.rounds} round(s)")
    if quiet:
        print(json.dumps({"results": rows, "targets": checks}, indent=1,
                         default=report.json_default))
    else:
        say(report.table(rows, wl_dicts))
        if cfg.quick:  # tiny sizes and one round: the figures check that every arm runs
            say("\nspeed targets: not judged in --quick (tiny workloads, one round); run "
                "without --quick for ratios")
        else:
            say(report.targets_table(checks))
        say(f"\n{json_path}\n{png_path}\nlogs: {logs}  ({doc['seconds']:.0f} s)")
    if host["loadavg_1min_max"] > cfg.cores:
        say(f"warning: the 1-minute load average reached {host['loadavg_1min_max']:.1f} on "
            f"{cfg.cores} cores during the run: other processes competed with the peers, and "
            f"the figures measure that too; rerun on a quiet machine")
    ok = all(r["rows_ok"] for r in rows)
    if not ok:
        say("some peers failed or miscounted rows: see 'rows' above and the logs")
    return 0 if ok else 1
