"""Command-line mistakes are one line naming the option and the fix (exit 2), before Ray
starts: `raying cluster`, `raying bench`, and the jobs' arguments and entry point."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

from raying.tools import cli

JOBS = Path(__file__).resolve().parents[3] / "jobs"


@pytest.mark.parametrize(("args", "says"), [
    (["--resources", "notjson"], "--resources 'notjson': expected a JSON object"),
    (["--resources", '{"gpu": -1}'], "non-negative amounts"),
    (["--env-file", "/nonexistent/secrets.env"], "--env-file /nonexistent/secrets.env: cannot "
                                                 "read it"),
    (["--port", "-1"], "argument --port: -1: not a port"),
    (["--dashboard-port", "99999"], "argument --dashboard-port: 99999: not a port"),
    (["--num-cpus", "-2"], "argument --num-cpus: -2: must be 0 or more"),
])
def test_cluster_start_refuses_bad_values_in_one_line(args, says, capsys, tmp_path):
    with pytest.raises(SystemExit) if "argument" in says else contextlib.nullcontext():
        assert cli.main(["cluster", "start", "--state-dir", str(tmp_path / "s"), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "s" / "cluster.json").exists()  # nothing was started


def test_cluster_state_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert cli.main(["cluster", "status", "--state-dir", str(tmp_path / "f")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_bench_out_or_data_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    for flag in ("--out", "--data"):
        other = "--data" if flag == "--out" else "--out"
        rc = cli.main(["bench", "--quick", "--workloads", "W1", "--peers", "L", flag,
                       str(tmp_path / "f"), other, str(tmp_path / "d")])
        assert rc == 2
        assert f"{flag} {tmp_path / 'f'}: cannot create that folder" in capsys.readouterr().err


def _common():
    sys.path.insert(0, str(JOBS))
    try:
        import _common as mod
    finally:
        sys.path.remove(str(JOBS))
    return mod


def test_job_numbers_must_be_positive_from_the_command_line_and_config(tmp_path, capsys):
    import argparse

    common = _common()

    def parser() -> argparse.ArgumentParser:  # a fresh one: --config sets its defaults
        p = argparse.ArgumentParser(prog="job")
        common.add_common_args(p)
        p.add_argument("--epochs", type=common.positive)
        return p

    with pytest.raises(SystemExit):
        common.parse_args(parser(), ["--smoke-test", "--epochs", "0"])
    assert "argument --epochs: 0: must be 1 or more" in capsys.readouterr().err
    cfg = tmp_path / "c.json"
    cfg.write_text('{"epochs": -3}')
    with pytest.raises(SystemExit):
        common.parse_args(parser(), ["--smoke-test", "--config", str(cfg)])
    assert "--epochs: -3: must be an integer of 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # neither data nor a smoke test: said before Ray starts
        common.parse_args(parser(), [])
    assert "--data URI is required" in capsys.readouterr().err
    assert common.parse_args(parser(), ["--smoke-test", "--epochs", "2"]).epochs == 2
    # Per-worker CPUs and learning rates: finite and above 0, before Ray starts (a negative
    # share was Ray Train's controller error 12 s in; a NaN rate trained to a NaN loss).
    def train_parser() -> argparse.ArgumentParser:
        p = parser()
        p.add_argument("--cpus-per-worker", type=float)
        p.add_argument("--lr", type=float)
        return p

    for bad in (["--cpus-per-worker", "-1"], ["--lr", "nan"], ["--lr", "0"]):
        with pytest.raises(SystemExit):
            common.parse_args(train_parser(), ["--smoke-test", *bad])
        assert f"argument {bad[0]}: " in capsys.readouterr().err
    got = common.parse_args(train_parser(), ["--smoke-test", "--cpus-per-worker", "0.5"])
    assert got.cpus_per_worker == 0.5


def test_prioritized_job_checks_its_sampler_before_the_uniform_arm_trains(capsys):
    sys.path.insert(0, str(JOBS))
    try:
        import train_prioritized
    finally:
        sys.path.remove(str(JOBS))
    for bad, says in ((["--beta", "-1"], "beta=...) must be in [0, 1]"),
                      (["--uniform-mix", "2"], "uniform_mix must be"),
                      (["--target", "5"], "--target is a balanced accuracy in (0, 1]")):
        with pytest.raises(SystemExit):
            train_prioritized.parse_args(["--smoke-test", *bad])
        assert says in capsys.readouterr().err
    # The uniform arm alone does not build the sampler.
    assert train_prioritized.parse_args(["--smoke-test", "--arms", "uniform", "--beta", "-1"])


def test_job_entry_point_turns_raying_errors_into_one_line(capsys):
    from raying.errors import StorageError

    common = _common()

    def main() -> int:
        raise StorageError("/x does not exist; check the path")

    assert common.run(main) == 2
    err = capsys.readouterr().err
    assert "error: StorageError: /x does not exist; check the path" in err
    assert "Traceback" not in err
    assert common.run(lambda: 0) == 0
    # With the job's parser, the fix is said in its flags.
    import argparse

    from raying.errors import ConfigError

    parser = argparse.ArgumentParser()
    parser.add_argument("--overwrite", action="store_true")

    def full() -> int:
        raise ConfigError("/out holds 3 shard files; pass overwrite=True to delete them first")

    assert common.run(full, parser) == 2
    assert "pass --overwrite to delete them first" in capsys.readouterr().err


def test_job_entry_point_finds_raying_errors_inside_ray_train_s(capsys):
    """Ray Train ends a run whose worker raised with its own error, the worker's message cut
    short: the job still says raying's error, whole, in one line (and which worker)."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raying.errors import StorageError

    common = _common()
    said = ("cannot connect to HDFS at 127.0.0.1:9000 to reach hdfs://127.0.0.1:9000/data (the "
            "NameNode did not answer). Check that the NameNode is up")

    def main() -> int:
        wrapped = UserExceptionWithTraceback(StorageError(said), "Traceback ...")
        raise WorkerGroupError("[Rank 1]\n...cut", {1: wrapped})

    assert common.run(main) == 2
    err = capsys.readouterr().err
    assert f"error: StorageError in Train worker 1: {said}" in err and "Traceback" not in err

    def other() -> int:  # not raying's: Ray's own error goes up unchanged
        raise WorkerGroupError("[Rank 0] boom", {0: UserExceptionWithTraceback(
            ValueError("boom"), "Traceback ...")})

    with pytest.raises(WorkerGroupError):
        common.run(other)

    def bug_while_handling() -> int:  # a bug raised while a raying error was handled
        try:
            raise StorageError("cannot read s3://b/x.jpg: timed out")
        except StorageError:
            return {}["missing"]

    with pytest.raises(KeyError):
        common.run(bug_while_handling)


def test_demo_refuses_zero_seeds():
    import argparse

    from raying.errors import ConfigError
    from raying.tools.demo import settings_from_args

    assert settings_from_args(argparse.Namespace(seeds=None)).seeds == (0,)
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=rf"--seeds must be >= 1, got {bad}"):
            settings_from_args(argparse.Namespace(seeds=bad))


def test_pack_takes_its_sizes_from_the_environment_unless_given(monkeypatch):
    from raying.tools import cli

    parser = cli.build_parser()
    ns = parser.parse_args(["pack", "src", "dst"])
    assert (ns.shard_rows, ns.row_group_rows) == (None, None)  # pack() reads RAYING_PACK_*
    ns = parser.parse_args(["pack", "src", "dst", "--shard-rows", "50", "--row-group-rows", "10"])
    assert (ns.shard_rows, ns.row_group_rows) == (50, 10)


def test_pack_refuses_an_on_error_it_does_not_know_before_any_work(tmp_path):
    import raying

    with pytest.raises(raying.ConfigError,
                       match=r"pack\(on_error=...\) must be 'skip' or 'raise', got 'rais'"):
        raying.pack(str(tmp_path / "src"), str(tmp_path / "dst"), on_error="rais")


def test_pack_columns_flag_takes_names_and_name_key_pairs():
    from raying.tools.cli import _columns_flag

    assert _columns_flag(None) is None and _columns_flag("") is None
    assert _columns_flag("caption, n,") == ["caption", "n"]
    assert _columns_flag("id:source_id,caption") == {"id": "source_id", "caption": "caption"}


def test_scan_of_parquet_with_integer_labels_says_how_many_labels(capsys, tmp_path):
    # classes: 0 alone read as "no labels" for a Parquet column of integer labels.
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    images = []
    for i in range(6):
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(buf, "JPEG")
        images.append(buf.getvalue())
    pq.write_table(pa.table({"image": images, "label": [0, 1, 2, 5, 0, 1]}),
                   tmp_path / "a.parquet")
    assert cli.main(["scan", str(tmp_path), "--format", "parquet"]) == 0
    out = capsys.readouterr().out
    assert "classes: none (no names)" in out
    assert "labels: 4 distinct integer labels (0 to 5), no names" in out
    assert cli.main(["scan", str(tmp_path), "--format", "parquet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] is None


def _folders(root: Path, counts: dict[str, int]) -> Path:
    import numpy as np
    from PIL import Image

    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(root / name / f"{i}.jpg")
    return root


def _cli(*args: str, **kwargs):
    import subprocess

    code = "import sys; from raying.tools import cli; sys.exit(cli.main(sys.argv[1:]))"
    import os

    kwargs.setdefault("stdout", subprocess.PIPE)
    # stdout buffered, as it is for a pipe unless PYTHONUNBUFFERED says otherwise.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", code, *args], stderr=subprocess.PIPE,
                          text=True, timeout=120, check=False, env=env, **kwargs)


def test_scan_warns_in_one_line_and_takes_class_names(tmp_path):
    root = _folders(tmp_path / "imgs", {"a": 2, "empty": 0, "z": 2})
    done = _cli("scan", str(root), "--json")
    assert done.returncode == 0, done.stderr
    warning = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warning) == 1, done.stderr  # no source file or line of raying's code
    assert warning[0].startswith("raying scan: warning: ") and "--classes" in warning[0]
    assert '"classes": 2' in done.stdout
    done = _cli("scan", str(root), "--json", "--classes", "a, empty, z")
    assert done.returncode == 0 and '"classes": 3' in done.stdout
    assert "warning" not in done.stderr


def test_extra_arguments_are_refused_with_the_commands_usage(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["scan", str(tmp_path), "extra"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: raying scan ") and "unrecognized arguments: extra" in err


def test_output_to_a_closed_pipe_stops_quietly(tmp_path):
    import os

    root = _folders(tmp_path / "imgs", {"a": 1, "b": 1})
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line (`raying scan ... | head -0`)
    try:
        done = _cli("scan", str(root), stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_cluster_start_on_a_port_in_use_names_the_fix(capsys, tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["cluster", "start", "--state-dir", str(tmp_path / "s"),
                         "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} is in use" in err and "--port 0" in err and "Traceback" not in err
    assert not (tmp_path / "s" / "cluster.json").exists()  # nothing was started


def test_a_second_cluster_start_on_the_same_state_dir_at_once_is_refused(capsys, tmp_path):
    """While one start holds the state dir (here: its lock), another is refused before it
    starts a head (both would find no head and start one; the second's state file would hide
    the first head)."""
    import fcntl

    state = tmp_path / "s"
    state.mkdir()
    with open(state / ".start.lock", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert cli.main(["cluster", "start", "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert "is starting its head now" in err and "Traceback" not in err
    assert not (state / "cluster.json").exists()  # nothing was started


def test_cluster_stop_without_a_head_is_done(capsys, tmp_path):
    """Stopping what is not running (a second `raying cluster stop`) succeeds and says so;
    status still fails for a head that was never started."""
    assert cli.main(["cluster", "stop", "--state-dir", str(tmp_path / "s")]) == 0
    assert "nothing to stop" in capsys.readouterr().out
    assert cli.main(["cluster", "status", "--state-dir", str(tmp_path / "s")]) == 2
    assert "no local head recorded" in capsys.readouterr().err


def test_parquet_with_two_binary_columns_needs_image_column_on_every_command(capsys,
                                                                            tmp_path):
    # advise measured such a set with no image column and advised as if decoding were free
    # (exit 0); scan and pack had no way to name the column from the command line.
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    def jpeg(i, side):
        buf = io.BytesIO()
        Image.fromarray(np.full((side, side, 3), i, np.uint8)).save(buf, "JPEG")
        return buf.getvalue()

    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"jpg": [jpeg(i, 16) for i in range(6)],
                             "thumb": [jpeg(i, 4) for i in range(6)],
                             "label": [0, 1, 2, 0, 1, 2]}), src / "a.parquet")
    for cmd in (["scan", str(src)], ["advise", str(src)]):
        assert cli.main(cmd) == 2
        err = capsys.readouterr().err
        assert "binary columns: ['jpg', 'thumb']); pass --image-column <name>" in err, err
    assert cli.main(["scan", str(src), "--label", "label", "--image-column", "jpg",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 6
    assert cli.main(["advise", str(src), "--image-column", "jpg", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"]["dataset"]["image_column"] == "jpg"
    assert report["measured"]["machine"]["decode_sampled"] == 6
    assert report["measured"]["machine"]["decode_ms_per_image"] is not None


def test_errors_name_the_commands_flags_not_the_librarys_keywords(capsys, tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=4, classes=2, size=(8, 8))
    one = next(root.rglob("*.jpg"))
    assert cli.main(["scan", str(one)]) == 2
    err = capsys.readouterr().err
    assert f"{one} names one image file, and --label folder (the default)" in err, err
    assert err.rstrip().endswith("unlabelled, pass --label none"), err
    assert cli.main(["pack", str(root), str(tmp_path / "out"), "--shard-rows", "0"]) == 2
    err = capsys.readouterr().err
    assert "rows must be >= 1, got --shard-rows 0 and --row-group-rows" in err, err
    (root / "a.parquet").write_bytes(b"")
    assert cli.main(["scan", str(root)]) == 2
    err = capsys.readouterr().err
    assert "say which it is: --format images (" in err and "or --format parquet (" in err, err
    # Keywords the command has no flag for stay the library's.
    from raying.tools.cli import _in_flags, _subparsers, build_parser

    scan = _subparsers(build_parser())["scan"]
    assert _in_flags("pass seed=3 or label=None.", scan) == "pass seed=3 or --label none."
    # Nor inside paths (hive partition folders) and URIs.
    text = "s3://b/t/label=3/a.parquet (hdfs://nn:9000/x?format=images): pass format='images'"
    assert _in_flags(text, scan) == ("s3://b/t/label=3/a.parquet (hdfs://nn:9000/x?format="
                                     "images): pass --format images")
    # Nor inside quoted names or file names; a value with spaces stays quoted.
    for kept in ("'seed=3' is not a folder", "file seed=1.parquet", r"C:\d\label=3\x",
                 "their hive folder is label=__HIVE_DEFAULT_PARTITION__/)"):
        assert _in_flags(kept, scan) == kept
    assert _in_flags("pass label='<column or key>'", scan) == "pass --label '<column or key>'"
    # columns= as pack's --columns (NAME:KEY for a column under another key); scan has none.
    pack = _subparsers(build_parser())["pack"]
    assert _in_flags("carry it: columns={'caption': 'image_', 'n': 'n'}", pack) == (
        "carry it: --columns caption:image_,n")
    assert _in_flags("columns=['id', 'x'] names ['id']", pack) == "--columns id,x names ['id']"
    assert _in_flags("columns={'id': 'source_id'}", scan) == "columns={'id': 'source_id'}"


def test_cluster_start_shows_the_token_files_real_mode(tmp_path, capsys):
    # A --token-file given was used as it was and printed as "mode 0600" whatever it was
    # (Ray's own ~/.ray/auth_token may be 0644).
    import os
    import types

    from raying.tools.cluster_cli import _print_started

    token = tmp_path / "auth_token"
    token.write_text("abc")
    fake = types.SimpleNamespace(address="127.0.0.1:6380", dashboard_url="http://127.0.0.1:8265",
                                 token_file=str(token), submit_command=lambda: "ray job submit")
    for mode, warned in ((0o644, True), (0o600, False)):
        os.chmod(token, mode)
        _print_started(fake)
        out = capsys.readouterr().out
        assert f"(mode {mode:04o};" in out, out
        assert ("others on this machine can read the token: chmod 600" in out) == warned


def test_a_ray_address_that_does_not_answer_is_one_line_naming_the_fix(monkeypatch, capsys,
                                                                       tmp_path):
    import ray

    from raying.tools.datagen import make_image_folder

    assert not ray.is_initialized()
    src = make_image_folder(tmp_path / "imgs", n=4, classes=2, size=(8, 8))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert cli.main(["pack", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raying pack: error: could not connect to Ray at 127.0.0.1:1")
    assert "unset RAY_ADDRESS" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing made before Ray was reached


def test_advise_says_what_it_found_where_the_format_asked_for_is_missing(capsys, tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=4, classes=2, size=(8, 8))
    assert cli.main(["advise", str(root), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "no Parquet files (*.parquet" in err, err
    assert f"found under {root}; found endings .jpg; check the URI, or use --format images for " \
        "an image folder" in err, err
    assert cli.main(["advise", str(root), "--format", "images"]) == 0  # what it holds
    capsys.readouterr()
    note = tmp_path / "notes.txt"
    note.write_text("not data")
    assert cli.main(["advise", str(note)]) == 2
    err = capsys.readouterr().err
    assert f"{note} names one file, which is neither Parquet" in err, err
    one = next(root.rglob("*.jpg"))  # one image named: measured as one
    assert cli.main(["advise", str(one), "--format", "images"]) == 0
    capsys.readouterr()
    shard = tmp_path / "one.parquet"
    shard.write_bytes(b"")
    assert cli.main(["advise", str(shard), "--format", "images"]) == 2
    err = capsys.readouterr().err
    assert "found endings .parquet" in err and "use --format parquet" in err, err


def test_scan_and_pack_say_the_flag_that_reads_what_they_found(capsys, tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=4, classes=2, size=(8, 8))
    # A column name is a Parquet label; an image folder's choices are spelled as flags.
    for command in (["scan", str(root)], ["pack", str(root), str(tmp_path / "out")]):
        assert cli.main([*command, "--label", "nocol"]) == 2
        err = capsys.readouterr().err
        assert "--label folder (its class folders)" in err and "--label none" in err, err
        assert "got 'nocol'" in err and "None" not in err, err
    assert not (tmp_path / "out").exists()
    shards = tmp_path / "pq"
    shards.mkdir()
    (shards / "part-0.parquet").write_bytes(b"")
    assert cli.main(["scan", str(shards), "--format", "images"]) == 2
    err = capsys.readouterr().err
    assert "found endings .parquet; these are Parquet files: pass --format parquet" in err, err
    assert "Manifest.scan" not in err, err
    (shards / "part-0.parquet").unlink()
    (shards / "readme.txt").write_text("x")  # no Parquet: the Python keyword is the way
    assert cli.main(["scan", str(shards), "--format", "images"]) == 2
    err = capsys.readouterr().err
    assert "found endings .txt; check the URI, or pass Manifest.scan(..., extensions=[...])" \
        in err, err
