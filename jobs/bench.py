"""Ray job: `raying bench` on the cluster (raying vs torch DataLoader, tf.data, Ray Data).

The benchmark itself lives in raying.bench (docs/benchmarks.md); this entrypoint gives it a
config file, a smoke test, and the run summary line every job prints.

Examples:
    ray job submit --working-dir . -- python jobs/bench.py --smoke-test
    ray job submit --working-dir . -- python jobs/bench.py --images 10000 --rounds 3 \\
        --workloads W1,W3 --out /mnt/results/bench
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# Options passed through to `raying bench` (see `raying bench --help`).
FORWARDED = ("images", "rounds", "workloads", "peers", "data")
# The smoke test: one workload, the limit and raying only (`--quick` alone runs every peer).
SMOKE = {"workloads": "W1", "peers": "L,raying"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Examples:"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="JSON or YAML file of option values")
    p.add_argument("--smoke-test", action="store_true", help="`raying bench --quick`")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks every peer runs")
    p.add_argument("--images", type=_common.positive, help="images in W1")
    p.add_argument("--rounds", type=_common.positive, help="interleaved rounds (median)")
    p.add_argument("--workloads", help="comma list, e.g. W1,W3")
    p.add_argument("--peers", help="comma list of peers")
    p.add_argument("--data", help="where generated workloads are cached")
    p.add_argument("--out", help="folder for JSON and PNG (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the summary as indented JSON")
    return p


def bench_argv(args: argparse.Namespace, out: str) -> list[str]:
    """The `raying bench` command line for these options."""
    argv = ["bench", "--out", out]
    if args.quick or args.smoke_test:
        argv.append("--quick")
    if args.smoke_test:
        for key, value in SMOKE.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for key in FORWARDED:
        value = getattr(args, key)
        if value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from this process: on this node, each peer in a child process with
    its own local Ray, as the benchmark protocol measures (not on the job's cluster)."""
    if importlib.util.find_spec("raying.bench.run") is None:
        msg = ("raying.bench.run is not in this raying install; update raying (the benchmark "
               "ships with it) and submit again")
        raise SystemExit(msg)
    from raying.tools.cli import main as cli_main

    out = _common.kept_output(args.out, "--out") or tempfile.mkdtemp(prefix="raying-bench-")
    argv = bench_argv(args, out)
    t0 = time.perf_counter()
    rc = cli_main(argv)
    results = sorted(str(p) for p in Path(out).glob("*.json")) if "://" not in out else []
    summary: dict[str, Any] = {"job": "bench", "command": "raying " + " ".join(argv),
                               "exit_code": rc, "out": out, "results": results,
                               "wall_s": round(time.perf_counter() - t0, 2)}
    if results:
        data = json.loads(Path(results[-1]).read_text())
        if isinstance(data, dict):
            summary["result_keys"] = sorted(data)[:20]
    # A smoke test's results are nobody's: not kept (a failed run's stay, to be looked into).
    if args.smoke_test and not args.out and rc == 0:
        shutil.rmtree(out, ignore_errors=True)
        summary["out"] = f"{out} (removed: a smoke test's)"
        summary["results"] = [Path(r).name for r in results]
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = _common.parse_args(build_parser(), argv)
    summary = run(args)
    _common.emit_summary("raying bench: summary", summary, as_json=args.json)
    return int(summary["exit_code"])


if __name__ == "__main__":
    sys.exit(_common.run(main, build_parser()))
