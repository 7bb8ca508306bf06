"""Ray Jobs on a real local head with token auth: the smoke job, refusals, and secret hygiene.

The head is started by this module (``raying.tools.cluster.start``: ``ray start --head`` in its own
session, own temp dir, free ports) and stopped at the end; nothing attaches to another cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raying.tools import cluster as rc
from raying.tools.cluster_cli import _read_env_file as read_env_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "jobs"))
import _common  # noqa: E402

JOB_TIMEOUT_S = 300
SMOKE_ENTRYPOINT = "python jobs/train_torch.py --smoke-test"
# A secret the cluster holds (as the AWS credentials variables); it must never surface.
CANARY = "canary-" + secrets.token_hex(12)


def _clean_env(home: Path) -> dict[str, str]:
    """A client environment with no token anywhere: no RAY_AUTH_*, an empty HOME."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    state = tmp_path_factory.mktemp("head")
    temp_before = set(Path(tempfile.gettempdir()).glob("pymp-*"))
    cluster = rc.start(port=0, dashboard_port=0, num_cpus=4, state_dir=state,
                       env={"AWS_ACCESS_KEY_ID": "AKIA" + CANARY,
                            "AWS_SECRET_ACCESS_KEY": CANARY})
    try:
        yield cluster
    finally:
        # Every process under the head (its agents rewrite their titles, and with them the
        # environment /proc shows, marker included), listed as the jobs left it.
        import psutil

        tree = psutil.Process(cluster.pid).children(recursive=True)
        rc.stop(cluster)
        assert rc.marked_pids(cluster.cluster_id) == [], "processes of the head were left"
        left = [f"{p.pid} {p.name()}" for p in tree
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes of the head outlived the stop: {left}"
        # The session's logs outlive the stop, for a look into a failed job; the secrets
        # of the head's environment are in none of them.
        kept = rc.logs_kept(cluster)
        assert list(kept.glob("job-driver-*.log")), sorted(p.name for p in kept.iterdir())
        assert kept.stat().st_mode & 0o077 == 0, oct(kept.stat().st_mode)  # owner only
        assert not os.path.exists(cluster.temp_dir)
        # What the head's processes put in the temp folder (multiprocessing's pymp-* of its
        # dashboard, the jobs' files) went into its own temp dir, removed with it.
        left_tmp = set(Path(tempfile.gettempdir()).glob("pymp-*")) - temp_before
        assert not left_tmp, sorted(map(str, left_tmp))
        for path in kept.rglob("*"):
            if path.is_file():
                assert CANARY not in path.read_text(errors="replace"), path


def _wait(client, job_id: str, timeout_s: float = JOB_TIMEOUT_S):
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(1.0)
    pytest.fail(f"job {job_id} still {status} after {timeout_s} s:\n"
                f"{client.get_job_logs(job_id)[-3000:]}")


def _session_logs(cluster: rc.LocalCluster) -> str:
    parts = []
    for path in Path(cluster.temp_dir).glob("session_*/logs/**/*"):
        if path.is_file():
            parts.append(path.read_bytes().decode("utf-8", errors="replace"))
    return "\n".join(parts)


def test_token_job_runs_the_smoke_job_and_keeps_the_secret(head, tmp_path):
    # The exact command `raying cluster start` prints, with its environment, from a shell
    # whose HOME holds no token: the token travels only through RAY_AUTH_TOKEN_PATH.
    before = {j.submission_id for j in head.job_client().list_jobs()}
    runs = Path(tempfile.gettempdir()) / "raying-train"  # the job's default run storage

    def run_folders():
        return set(os.listdir(runs)) if runs.is_dir() else set()

    runs_before = run_folders()
    proc = subprocess.run(head.submit_command(SMOKE_ENTRYPOINT), shell=True, cwd=REPO,
                          env=_clean_env(tmp_path), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    client = head.job_client()
    (job,) = [j for j in client.list_jobs() if j.submission_id not in before]
    logs = client.get_job_logs(job.submission_id)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert str(client.get_job_status(job.submission_id)) == "SUCCEEDED", logs[-4000:]
    assert _common.find_summary(proc.stdout) is not None, "the CLI tailed no summary"
    summary = _common.find_summary(logs)
    assert summary is not None, "the job's logs hold no run summary"
    assert summary["job"] == "train_torch" and summary["workers"] == 2
    assert run_folders() <= runs_before  # its run, under a random name, was not kept
    for epoch in ("0", "1"):
        assert summary["epochs"][epoch]["rows"] == summary["samples"]
        assert summary["epochs"][epoch]["exactly_once"] is True
    assert summary["store"]["updates_received"] == 2 * summary["samples"]
    assert summary["store"]["never_updated_share"] == 0.0
    # The job saw the cluster's credentials (by name) ...
    assert "AWS_SECRET_ACCESS_KEY" in summary["credentials"]
    # ... and their values appear nowhere: job info, job logs, the head's session logs.
    info = json.dumps(client.get_job_info(job.submission_id).dict(), default=str)
    assert CANARY not in info
    assert CANARY not in logs
    assert CANARY not in _session_logs(head)


def test_submission_without_token_is_refused(head, tmp_path):
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    before = len(head.job_client().list_jobs())
    # The same command as above, less the two variables that point the client at the token.
    command = head.submit_command(SMOKE_ENTRYPOINT)
    for key, value in head.client_env().items():
        command = command.replace(f"{key}={value} ", "")
    # `ray`, or the one beside this Python when the shell's PATH has none (a virtualenv).
    assert command.split(" ", 1)[0].endswith("ray") and " job submit " in command
    proc = subprocess.run(command, shell=True, cwd=REPO, env=_clean_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Unauthorized: Missing authentication token" in proc.stdout + proc.stderr
    # A wrong token is refused too.
    with pytest.raises(AuthenticationError, match="Forbidden"):
        JobSubmissionClient(head.dashboard_url,
                            headers={"Authorization": "Bearer " + "0" * 64}).list_jobs()
    assert len(head.job_client().list_jobs()) == before, "a refused submission created a job"


def test_a_driver_with_the_wrong_token_is_told_the_token_was_refused(head, tmp_path):
    """A stale token file: Ray said only that it failed to connect (to an address the user
    did not give), as if the head were down; the cause was in its C++ warnings."""
    wrong = tmp_path / "stale_token"
    wrong.write_text("0" * 64)
    env = {**_clean_env(tmp_path), "RAY_ADDRESS": head.address, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(wrong)}
    code = ("from raying.engine.ray_setup import ensure_ray\n"
            "try:\n    ensure_ray()\nexcept ConnectionError as exc:\n"
            "    print('REFUSED', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    said = proc.stdout
    assert "REFUSED" in said, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"Something answers at {head.address}" in said
    assert f"refused the token this process sent (from {wrong})" in said


def test_secret_in_runtime_env_shows_in_job_info(head):
    """Why docs/secrets.md forbids runtime_env env_vars: Ray stores and serves them."""
    leak = "leak-" + secrets.token_hex(8)
    client = head.job_client()
    job_id = client.submit_job(entrypoint="python -c \"print('ok')\"",
                               runtime_env={"env_vars": {"SOME_TOKEN": leak}})
    assert str(_wait(client, job_id, 120)) == "SUCCEEDED"
    assert leak in json.dumps(client.get_job_info(job_id).dict(), default=str)


def test_coverage_counts_each_rank_s_last_attempt_and_still_catches_a_double_read():
    import numpy as np

    def rec(rank, epoch, ids, attempt):
        return {"rank": rank, "epoch": epoch, "rows": len(ids), "loss_sum": 0.0,
                "ids": np.asarray(ids), "attempt": f"{attempt}-{rank}"}

    # Ranks 0 and 1 read epochs 0 and 1; the group failed and restarted (new processes) from
    # the epoch-0 checkpoint, so epoch 1 was read again whole (in another order), then 2.
    first = [rec(0, 0, [0, 2], "a"), rec(1, 0, [1, 3], "a"), rec(0, 1, [3, 0], "a"),
             rec(1, 1, [1, 2], "a")]
    retry = [rec(1, 1, [0, 1], "b"), rec(0, 1, [2, 3], "b"), rec(0, 2, [1, 0], "b"),
             rec(1, 2, [3, 2], "b")]
    cov = _common.epoch_coverage(first + retry, 4)
    assert [cov[e]["exactly_once"] for e in (0, 1, 2)] == [True, True, True]
    assert [cov[e]["reread"] for e in (0, 1, 2)] == [0, 2, 0]
    assert cov[1]["rows"] == 4 and cov[1]["workers"] == 2
    # One process that read an epoch twice (no restart) is a double read, not hidden.
    cov = _common.epoch_coverage([rec(0, 0, [0, 2], "a"), rec(1, 0, [1, 3], "a"),
                                  rec(0, 0, [2, 0], "a")], 4)
    assert not cov[0]["exactly_once"] and cov[0]["repeated"] == 2 and cov[0]["reread"] == 0
    assert cov[0]["rows_by_rank"] == {0: 4, 1: 2}
    # A rank that read an id twice within its read is caught.
    cov = _common.epoch_coverage([rec(0, 0, [0, 0], "a"), rec(1, 0, [1, 3], "a")], 4)
    assert not cov[0]["exactly_once"] and cov[0]["repeated"] == 1 and cov[0]["missing"] == 1


def test_config_file_sets_defaults_the_command_line_overrides(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "jobs"))
    import train_torch

    cfg = tmp_path / "run.yaml"
    cfg.write_text("epochs: 5\nbatch-size: 8\nsampler: prioritized\ndata: /some/where\n")
    args = _common.parse_args(train_torch.build_parser(),
                              ["--config", str(cfg), "--epochs", "3"])
    assert (args.epochs, args.batch_size, args.sampler) == (3, 8, "prioritized")
    assert args.data == "/some/where"
    cfg.write_text('{"epoch": 5}')
    with pytest.raises(SystemExit):
        _common.parse_args(train_torch.build_parser(), ["--config", str(cfg)])
    # A value from the file is checked as the command line's is: a misspelt choice stops
    # the job instead of running another sampler than the one asked for.
    cfg.write_text('{"smoke_test": true, "sampler": "prioritised"}')
    with pytest.raises(SystemExit):
        _common.parse_args(train_torch.build_parser(), ["--config", str(cfg)])
    err = capsys.readouterr().err
    assert "argument --sampler: invalid choice: 'prioritised' (choose from 'uniform', " in err
    # A switch spelt "false" in the file would be truthy (a smoke test, or GPUs asked for);
    # a negative failure count is no count.
    for text, pattern in (('{"smoke_test": "false"}', "--smoke-test: 'false': a switch takes "
                                                      "true or false"),
                          ('{"smoke_test": true, "max_failures": -7}',
                           "--max-failures: -7: must be -1")):
        cfg.write_text(text)
        with pytest.raises(SystemExit):
            _common.parse_args(train_torch.build_parser(), ["--config", str(cfg)])
        assert pattern in capsys.readouterr().err


def test_a_job_run_in_ray_s_copy_of_its_working_dir_refuses_relative_outputs(tmp_path,
                                                                              monkeypatch):
    # `ray job submit --working-dir .` runs the driver in a copy under the head's temp dir,
    # which `raying cluster stop` removes: a relative --dst or --out would vanish with it.
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    assert _common.in_job_copy()
    with pytest.raises(SystemExit, match=r"--dst 'packed' is a relative path, and this job "
                                         r"runs in Ray's copy of its working directory"):
        _common.kept_output("packed", "--dst")
    for kept in ("/data/packed", "s3://b/packed", None):
        assert _common.kept_output(kept, "--dst") == kept
    monkeypatch.chdir(tmp_path)
    assert not _common.in_job_copy() and _common.kept_output("packed", "--dst") == "packed"


def test_a_submitted_smoke_test_keeps_its_report_out_of_a_full_runs_folder(tmp_path,
                                                                            monkeypatch):
    """In Ray's copy of the working directory a full run's report goes to the temp folder's
    raying-report/; a smoke test's went there too and replaced the last full run's."""
    import train_prioritized

    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    _, full = train_prioritized.output_dirs(train_prioritized.parse_args([]))
    data, smoke = train_prioritized.output_dirs(train_prioritized.parse_args(["--smoke-test"]))
    assert full == tmp_path / "tmp" / train_prioritized.DEFAULT_OUT
    assert smoke != full and "smoke" in str(smoke) and "smoke" in str(data)


def test_env_file_errors_never_echo_values(tmp_path):
    from raying.errors import ConfigError

    env = tmp_path / "secrets.env"
    env.write_text("# cluster secrets\nexport AWS_ACCESS_KEY_ID=abc\nAWS_SECRET_ACCESS_KEY='s3cr3t'\n")
    assert read_env_file(str(env)) == {"AWS_ACCESS_KEY_ID": "abc",
                                       "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    env.write_text("TOKEN s3cr3t-value\n")
    with pytest.raises(ConfigError, match="expected KEY=VALUE") as err:
        read_env_file(str(env))
    assert "s3cr3t" not in str(err.value)


def test_the_tf_job_smoke_test_runs_every_worker_in_step_and_keeps_no_run_folder(tmp_path):
    # jobs/train_tf.py is the guide's TensorflowTrainer loop: every worker runs the same
    # steps (MultiWorkerMirroredStrategy's collectives need it), and its run, under a random
    # name, is not kept in the default storage.
    runs = Path(tempfile.gettempdir()) / "raying-train"
    before = set(os.listdir(runs)) if runs.is_dir() else set()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "jobs/train_tf.py", "--smoke-test"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = _common.find_summary(proc.stdout)
    assert summary is not None and summary["job"] == "train_tf", proc.stdout[-2000:]
    assert summary["epochs"], summary
    for epoch, e in summary["epochs"].items():
        steps = set(e["steps_by_rank"].values())
        assert len(e["steps_by_rank"]) == summary["workers"] and len(steps) == 1, (epoch, e)
        assert e["rows"] > 0 and e["loss"] > 0, (epoch, e)
    after = set(os.listdir(runs)) if runs.is_dir() else set()
    assert after <= before, sorted(after - before)


def test_a_head_started_over_a_dead_one_stops_what_the_dead_one_left(tmp_path):
    # A head killed at once (SIGKILL: no chance to stop its node) leaves its agents and temp
    # dir; starting a new head from the same state dir stops those first.
    import signal

    state = tmp_path / "state"
    first = rc.start(port=0, dashboard_port=0, num_cpus=1, state_dir=state)
    second = None
    try:
        assert rc.marked_pids(first.cluster_id)
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while rc.pid_alive(first.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        second = rc.start(port=0, dashboard_port=0, num_cpus=1, state_dir=state)
        assert rc.marked_pids(first.cluster_id) == []
        assert not os.path.exists(first.temp_dir)
        assert rc.marked_pids(second.cluster_id)
    finally:
        rc.stop(second or first)
        if second is not None:
            assert rc.marked_pids(second.cluster_id) == []
        rc.stop(first)  # nothing left of it: a no-op


@pytest.mark.parametrize(("job", "prefix"), [("pack", "raying-packed-"),
                                             ("bench", "raying-bench-")])
def test_the_pack_and_bench_smoke_tests_run_and_keep_nothing(job, prefix):
    import shutil

    # What they leave behind would be here (short: Ray's socket paths go under it too).
    tmp_path = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, f"jobs/{job}.py", "--smoke-test", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("RAYING_SUMMARY", 1)[1].splitlines()[0])
    assert summary["job"] == job
    if job == "pack":
        assert summary["rows"] == summary["scanned_back"] == summary["source_samples"] > 0
    else:
        assert summary["exit_code"] == 0 and summary["results"] == ["bench.json"]
    try:  # (raying-bench-data: the benchmark's generated images, kept to be reused)
        left = [p.name for p in tmp_path.glob(f"{prefix}*") if p.name != "raying-bench-data"]
        assert not left, sorted(p.name for p in tmp_path.iterdir())
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_job_driver_on_a_head_writes_its_temp_files_where_the_caller_would(monkeypatch,
                                                                            tmp_path):
    # The head's processes keep their temp files in its temp dir (removed at stop); a job's
    # driver, started with that TMPDIR, takes back the caller's for its outputs.
    import tempfile as tf

    from raying.tools.cluster import HEAD_TMPDIR_ENV

    for caller, want in ((str(tmp_path), str(tmp_path)), ("", None)):
        monkeypatch.setenv("TMPDIR", "/tmp/rc-head")
        monkeypatch.setenv(HEAD_TMPDIR_ENV, caller)
        _common.caller_tmpdir()
        assert os.environ.get("TMPDIR") == want and HEAD_TMPDIR_ENV not in os.environ
        assert tf.gettempdir() == (want or "/tmp")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # not on a head: left alone
    _common.caller_tmpdir()
    assert os.environ["TMPDIR"] == str(tmp_path)
    tf.tempdir = None
