"""Ray job: pack an image folder into Parquet shards (one Ray task per shard), then check it.

Parquet of encoded bytes (or pre-decoded uint8 with --decode-size) reads a row group per
request instead of a file per image: what large datasets on object storage want. The job
scans the result back, so a bad pack fails here, not in training.

Examples:
    ray job submit --working-dir . -- python jobs/pack.py --smoke-test
    ray job submit --working-dir . -- python jobs/pack.py --data s3://bucket/images \\
        --dst s3://bucket/packed --decode-size 160
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Examples:"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--dst", metavar="URI", help="output folder (default: a temp dir)")
    p.add_argument("--decode-size", type=_common.positive, help="store pre-decoded uint8 SxS pixels")
    p.add_argument("--shard-rows", type=_common.positive, help="rows per Parquet file")
    p.add_argument("--row-group-rows", type=_common.positive, help="rows per row group")
    p.add_argument("--on-error", choices=["skip", "raise"], default="skip")
    p.add_argument("--verify", action="store_true", help="fully decode every image first")
    p.add_argument("--overwrite", action="store_true",
                   help="delete Parquet files already in --dst first (else they are refused)")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep the source order (default: rows shuffled across shards by --seed)")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Pack, scan the result back, and return the summary."""
    import raying
    from raying.engine.ray_setup import ensure_ray
    from raying.options import settings

    ensure_ray()
    t0 = time.perf_counter()
    src = _common.manifest(args)
    dst = _common.kept_output(args.dst, "--dst") or tempfile.mkdtemp(prefix="raying-packed-")
    shard_rows = args.shard_rows or (32 if args.smoke_test else settings().pack_shard_rows)
    group_rows = args.row_group_rows or (16 if args.smoke_test else settings().pack_row_group_rows)
    res = raying.pack(src, dst, decode_size=args.decode_size, shard_rows=shard_rows,
                      row_group_rows=group_rows, storage=_common.storage_options(args),
                      dst_storage=_common.storage_options(args), on_error=args.on_error,
                      verify=args.verify, progress=False, overwrite=args.overwrite,
                      shuffle=not args.no_shuffle, seed=args.seed)
    back = raying.Manifest.scan(dst, format="parquet", label="label",
                                storage=_common.storage_options(args))
    summary = {"job": "pack", "source_samples": len(src), **res.summary(),
               "scanned_back": len(back), "classes": len(back.classes or []),
               "row_groups": len(back.row_group_table()[0]),
               "skipped_reasons": sorted({s["reason"] for s in res.skipped}),
               "credentials": _common.credentials_source(),
               "wall_s": round(time.perf_counter() - t0, 2)}
    if len(back) != res.rows:
        msg = f"packed {res.rows} rows but {dst} scans back {len(back)}"
        raise SystemExit(msg)
    if args.smoke_test and not args.dst:  # a smoke test's shards are nobody's: not kept
        shutil.rmtree(dst, ignore_errors=True)
        summary["dst"] = f"{dst} (removed: a smoke test's)"
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = _common.parse_args(build_parser(), argv)
    _common.emit_summary("raying pack: summary", run(args), as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main, build_parser()))
