"""The `raying` command: demo, scan, pack, bench, advise, cluster."""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from raying.errors import RayingError

EXAMPLES = {
    "demo": "raying demo            # the main job: generated data, uniform vs prioritized\n"
            "  raying demo --quick    # the same in under a minute",
    "scan": "raying scan ./images/\n  raying scan s3://bucket/train --endpoint-url "
            "http://127.0.0.1:9000 --json",
    "pack": "raying pack ./images/ ./packed/\n  raying pack ./images/ ./packed-224/ "
            "--decode-size 224\n  raying pack ./captioned-parquet/ ./packed-256/ "
            "--decode-size 256 --columns caption",
    "bench": "raying bench --quick\n  raying bench --images 10000 --rounds 3 --out bench-results/",
    "advise": "raying advise ./images/\n  raying advise s3://bucket/train --json",
    "cluster": "raying cluster start   # a local head with token auth\n"
               "  raying cluster status\n"
               "  raying cluster start --env-file ~/.config/raying/secrets.env\n"
               "  raying cluster stop",
}


def _storage_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("storage (defaults: the standard AWS environment)")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    g.add_argument("--region", help="S3 region")
    g.add_argument("--anonymous", action="store_true", help="read a public bucket unsigned")
    g.add_argument("--profile", help="AWS profile of the shared config files")


def _storage(ns: argparse.Namespace) -> dict[str, Any] | None:
    opts = {k: getattr(ns, k) for k in ("endpoint_url", "region", "profile")
            if getattr(ns, k, None)}
    if getattr(ns, "anonymous", False):
        opts["anonymous"] = True
    return opts or None


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    for k, v in data.items():
        print(f"{k:>22}: {v}")


IMAGE_COLUMN_HELP = ("Parquet's image column (default: 'image', else the one binary "
                     "column)")


def cmd_scan(ns: argparse.Namespace) -> int:
    import numpy as np

    from raying.dataset.manifest import Manifest

    label = None if ns.label == "none" else ns.label
    classes = _classes_flag(ns.classes)
    m = Manifest.scan(ns.uri, format=ns.format, label=label, storage=_storage(ns),
                      classes=classes, image_column=ns.image_column)
    if ns.save:
        m.save(ns.save)
    sizes = m.sizes[m.sizes >= 0]
    out = {"uri": ns.uri, "format": m.format, "samples": len(m),
           # Integer labels of a Parquet column have no names: "labels" below says them.
           "classes": len(m.classes) if m.classes else (None if ns.json else "none (no names)"),
           "bytes": int(sizes.sum()) if len(sizes) else 0,
           "files": len(m.files) if m.format == "parquet" else len(m)}
    if m.format == "parquet":  # a Parquet row's size is its row group's mean: no median
        out["mean_sample_bytes"] = int(sizes.mean()) if len(sizes) else 0
    else:
        out["median_sample_bytes"] = int(np.median(sizes)) if len(sizes) else 0
    out["files"] = out.pop("files")
    if not m.classes:
        out["labels"] = _label_values(m)
    if m.format == "parquet":
        out["row_groups"] = len(m.row_group_table()[0])
        decoded = m.meta.get("decoded")  # the stored pixels' shape, or None: encoded images
        out["decoded"] = decoded if decoded is not None or ns.json else "no (encoded images)"
    if ns.save:
        out["manifest"] = ns.save
    _print(out, ns.json)
    return 0


def _label_values(m) -> str:
    """Without class names (integer labels of a Parquet column): how many distinct labels,
    and their range."""
    import numpy as np

    labels = m.labels
    labels = labels[labels >= 0] if labels is not None else np.zeros(0)
    if not len(labels):
        return "none"
    return (f"{len(np.unique(labels))} distinct integer labels ({int(labels.min())} to "
            f"{int(labels.max())}), no names")


def _columns_flag(text: str | None) -> list[str] | dict[str, str] | None:
    """``--columns a,b`` as a list; with ``name:key`` items, a dict (a column written under
    another name: ``--columns id:source_id,caption``)."""
    if not text:
        return None
    items = [c.strip() for c in text.split(",") if c.strip()]
    if not any(":" in c for c in items):
        return items
    pairs = [tuple(p.strip() for p in c.split(":", 1)) if ":" in c else (c, c) for c in items]
    return dict(pairs)


def _classes_flag(value: str | None) -> list[str] | None:
    """``--classes a,b,c`` as a list (None when not given)."""
    return [c.strip() for c in value.split(",") if c.strip()] if value else None


def cmd_pack(ns: argparse.Namespace) -> int:
    from raying.engine.pack import pack

    res = pack(ns.src, ns.dst, decode_size=ns.decode_size, shard_rows=ns.shard_rows,
               row_group_rows=ns.row_group_rows, storage=_storage(ns),
               on_error=ns.on_error, verify=ns.verify, progress=not ns.json,
               label=None if ns.label == "none" else ns.label, overwrite=ns.overwrite,
               shuffle=not ns.no_shuffle, seed=ns.seed,
               columns=_columns_flag(ns.columns), format=ns.format,
               image_column=ns.image_column, classes=_classes_flag(ns.classes))
    out = res.summary()
    _print(out, ns.json)
    for s in res.skipped[:20]:
        print(f"skipped id {s['id']} {s['path']}: {s['reason']} {s['detail']}", file=sys.stderr)
    if res.rows == 0 and res.skipped:  # nothing packed: a script must not go on as if it had
        print(f"raying pack: error: every one of the {len(res.skipped)} samples was set aside "
              f"(see the reasons above); {ns.dst} holds no rows", file=sys.stderr)
        return 1
    return 0


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).__dict__[func](ns)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raying", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  " + "\n  ".join(
                                    v.split("\n")[0] for v in EXAMPLES.values()))
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_,
                              epilog="examples:\n  " + EXAMPLES[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    s = add("scan", "List a dataset once and print what raying sees.")
    s.add_argument("uri", help="folder or file: path, file://, s3://, hdfs://")
    s.add_argument("--format", default="auto", choices=["auto", "images", "parquet"])
    s.add_argument("--label", default="folder",
                   help="'folder' (class subfolders), a Parquet column name, or 'none'")
    s.add_argument("--classes", metavar="NAMES",
                   help="comma-separated class names in label order (e.g. the training "
                        "split's), instead of the class folders found")
    s.add_argument("--image-column", default=None, metavar="NAME", help=IMAGE_COLUMN_HELP)
    s.add_argument("--save", metavar="URI", help="also write the manifest there")
    s.add_argument("--json", action="store_true", help="print JSON")
    _storage_args(s)
    s.set_defaults(func=cmd_scan)

    k = add("pack", "Pack an image folder (or Parquet of encoded images) into Parquet shards "
                    "(Ray tasks, with progress).")
    k.add_argument("src", help="image folder, or folder of Parquet files of encoded images")
    k.add_argument("dst", help="output folder")
    k.add_argument("--decode-size", type=int, default=None,
                   help="store pre-decoded uint8 SxS pixels (fixed_size_binary)")
    k.add_argument("--shard-rows", type=int, default=None,
                   help="rows per Parquet shard (default: RAYING_PACK_SHARD_ROWS, 4096)")
    k.add_argument("--row-group-rows", type=int, default=None,
                   help="rows per row group (default: RAYING_PACK_ROW_GROUP_ROWS, 256)")
    k.add_argument("--on-error", default="skip", choices=["skip", "raise"])
    k.add_argument("--image-column", default=None, metavar="NAME", help=IMAGE_COLUMN_HELP)
    k.add_argument("--classes", metavar="NAMES",
                   help="comma-separated class names in label order (e.g. the training "
                        "split's), instead of the class folders found")
    k.add_argument("--verify", action="store_true", help="fully decode every image first")
    k.add_argument("--label", default="folder",
                   help="'folder' (class subfolders; for Parquet the 'label' column), a "
                        "Parquet label column's name, or 'none' (unlabelled)")
    k.add_argument("--columns", default=None, metavar="A,B",
                   help="Parquet input: extra columns to carry into the shards (comma list; "
                        "NAME:KEY writes column NAME as KEY, e.g. id:source_id)")
    k.add_argument("--format", default="auto", choices=["auto", "images", "parquet"],
                   help="what SRC holds (auto: Parquet when it has .parquet files)")
    k.add_argument("--overwrite", action="store_true",
                   help="delete Parquet files already in DST first (else they are refused)")
    k.add_argument("--no-shuffle", action="store_true",
                   help="keep the folder's order (default: rows in a random order, so that "
                        "row groups, and batches, mix classes)")
    k.add_argument("--seed", type=int, default=0, help="seed of the rows' random order")
    k.add_argument("--json", action="store_true", help="print JSON")
    _storage_args(k)
    k.set_defaults(func=cmd_pack)

    d = add("demo", "The main job: uniform vs prioritized training on generated data.")
    d.add_argument("--quick", action="store_true", help="a smaller run, under a minute")
    d.add_argument("--out", default="raying-report", help="report folder")
    d.add_argument("--data", default=None, help="where the generated dataset is cached")
    d.add_argument("--seeds", type=int, default=None, help="seeds per arm")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(func=_lazy("raying.tools.demo", "main"))

    b = add("bench", "Benchmark raying against torch DataLoader, tf.data and Ray Data.")
    b.add_argument("--quick", action="store_true",
                   help="tiny sizes: checks every peer runs (the Ray Train peers in the iterate "
                        "mode, raying's on W1 and W3, Ray Data's on W1)")
    b.add_argument("--images", type=int, default=None, help="images in W1")
    b.add_argument("--rounds", type=int, default=None, help="interleaved rounds (median)")
    b.add_argument("--workloads", default=None, help="comma list, e.g. W1,W3")
    b.add_argument("--peers", default=None, help="comma list of peers")
    b.add_argument("--out", default="bench-results", help="folder for JSON and PNG")
    b.add_argument("--data", default=None, help="where generated workloads are cached")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--epochs", type=int, default=None,
                   help="epochs per cell, the first one cold (default 3; quick 2)")
    b.add_argument("--batch-sizes", default=None, help="comma list (default 64,256; quick 64)")
    b.add_argument("--modes", default=None,
                   help="consumer modes: iterate,sleep,compute (quick: iterate,compute)")
    b.add_argument("--w2-images", type=int, default=None, help="images in W2 (default 2000)")
    b.add_argument("--w6-images", type=int, default=None,
                   help="images in W6, ImageNet-like (default 20000)")
    b.add_argument("--w4-images", type=int, default=None, help="rows in W4 (default: W1's)")
    b.add_argument("--decode-size", type=int, default=None,
                   help="side of W4's stored pixels (default 256; crops of 224)")
    b.add_argument("--cores", type=int, default=None,
                   help="workers/CPUs every peer may use (default: this process's CPUs)")
    b.add_argument("--isolate", choices=["workload", "peer"], default=None,
                   help="one process per (workload, peer), or per peer (default: workload; "
                        "quick: peer)")
    b.add_argument("--sleep-ms", type=float, default=None,
                   help="sleep mode: ms per image slept by the consumer (default 0.25)")
    b.add_argument("--work-ms", type=float, default=None,
                   help="compute mode: CPU ms per image done by the consumer (default 0.25)")
    b.add_argument("--work-kb-per-image", type=float, default=None,
                   help="compute mode: fixed KiB of sha256 per image instead of --work-ms")
    b.add_argument("--timeout", type=float, default=None,
                   help="seconds one measurement may take (default 1800; quick 300)")
    b.set_defaults(func=_lazy("raying.bench.run", "main"))

    a = add("advise", "Measure a dataset, its storage and this machine; recommend a config.")
    a.add_argument("uri", help="dataset URI")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.add_argument("--image-column", default=None, metavar="NAME", help=IMAGE_COLUMN_HELP)
    a.add_argument("--format", choices=["auto", "images", "parquet"], default="auto",
                   help="what the folder holds (default: auto, as scan)")
    _storage_args(a)
    a.set_defaults(func=_lazy("raying.tools.advise", "main"))

    c = add("cluster", "Start, check or stop a local Ray head with token authentication.")
    c.add_argument("action", choices=["start", "stop", "status"])
    c.add_argument("--port", type=_port, default=6380, help="GCS port (0: a free one)")
    c.add_argument("--dashboard-port", type=_port, default=8265,
                   help="job API / dashboard port on 127.0.0.1 (0: a free one)")
    c.add_argument("--num-cpus", type=_count, default=None, help="logical CPUs of the head")
    c.add_argument("--resources", default=None, metavar="JSON",
                   help='custom resources, e.g. \'{"trainer": 1}\'')
    c.add_argument("--token-file", default=None,
                   help="where the auth token is kept (default <state-dir>/auth_token)")
    c.add_argument("--state-dir", default=None,
                   help="state file, token and log of the head (default ~/.raying/cluster)")
    c.add_argument("--env-file", default=None, metavar="FILE",
                   help="KEY=VALUE lines set in every process of the head: secrets for the "
                        "jobs, kept out of job submissions (see docs/secrets.md)")
    c.set_defaults(func=_lazy("raying.tools.cluster_cli", "main"))
    return p


def _bounded(text: str, low: int, high: int | None, fix: str) -> int:
    value = int(text)
    if value < low or (high is not None and value > high):
        msg = f"{value}: {fix}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _port(text: str) -> int:
    return _bounded(text, 0, 65535, "not a port: use 1-65535 (0: a free one)")


def _count(text: str) -> int:
    return _bounded(text, 0, None, "must be 0 or more")


def positive_int(text: str) -> int:
    """argparse type: an integer of 1 or more (also the jobs' sizes and counts)."""
    return _bounded(text, 1, None, "must be 1 or more")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # reported with the usage of the command they were given to
        command = getattr(ns, "command", None)
        target = _subparsers(parser).get(command, parser) if command else parser
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    # A warning is one line of the command's output, not a source line of raying's code.
    previous = warnings.formatwarning
    warnings.formatwarning = (lambda message, category, *a, **k:
                              f"raying {ns.command}: warning: {message}\n")
    try:
        code = int(ns.func(ns) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except RayingError as exc:
        text = _in_flags(str(exc), _subparsers(parser).get(ns.command))
        print(f"raying {ns.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"raying {ns.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket broke: an error to show
        # The reader of stdout went away (`raying scan ... | head`): stop quietly, and keep
        # the interpreter's exit flush from failing on the closed pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    finally:
        warnings.formatwarning = previous


def _stdout_closed() -> bool:
    """stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real file behind stdout
        return False


# A keyword argument in prose, not inside a path or URI (hive folders: .../label=3/...).
_KEYWORD = re.compile(r"(?<![\w/\\=.?&'\"-])([a-z_]+)=(None|True|False|'[^']*'|\"[^\"]*\"|"
                      r"-?\d+(?:\.\d+)?|\w+)(?![\w/\\=]|\.\w|')")


def _in_flags(text: str, command: argparse.ArgumentParser | None) -> str:
    """An error's fix in the command's own words: the library's errors name keyword
    arguments (``label=None``, ``format='images'``), which this command spells as flags
    (``--label none``, ``--format images``); keywords it has no flag for stay as they are."""
    if command is None:
        return text
    flags = {a.dest: a for a in command._actions if a.option_strings}

    def flag(m: re.Match) -> str:
        action = flags.get(m.group(1))
        if action is None:
            return m.group(0)
        name = max(action.option_strings, key=len)
        value = m.group(2).strip("'\"")
        if action.nargs == 0:  # a switch: --verify for verify=True
            return name if value == "True" else m.group(0)
        if value == "None":
            if "none" not in str(action.help or "") and action.dest != "label":
                return m.group(0)
            value = "none"
        return f"{name} {value!r}" if " " in value else f"{name} {value}"

    if "columns" in flags:  # columns={'a': 'b'} / columns=['a'] as --columns a:b / a
        def columns(m: re.Match) -> str:
            try:
                value = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                return m.group(0)
            if isinstance(value, dict):
                items = [a if a == b else f"{a}:{b}" for a, b in value.items()]
            elif isinstance(value, (list, tuple)):
                items = [str(a) for a in value]
            else:
                return m.group(0)
            return f"--columns {','.join(map(str, items))}"

        text = _COLUMNS.sub(columns, text)
    return _KEYWORD.sub(flag, text)


# A columns= keyword whose value is a dict or list literal (no nested brackets).
_COLUMNS = re.compile(r"\bcolumns=(\{[^{}]*\}|\[[^\[\]]*\])")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands' parsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
