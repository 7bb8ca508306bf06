"""`raying bench`: every peer runs and delivers exactly the expected rows; the watcher counts.

Speed is never asserted here: the quick bench's figures are noise on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from raying.bench import aggregate, measure, report, run
from raying.bench.child import PEER_WORKLOADS, check_batch, peer_workloads, steady
from raying.errors import ConfigError
from raying.read import task as read_task


# -- pieces, no Ray --------------------------------------------------------------------------------
def test_tree_watch_counts_cpu_of_children_and_the_dead():
    """CPU of a forked child that exits is kept at its last reading."""
    code = ("import os, sys, time\n"
            "sys.stdin.readline()\n"  # burn only once the window has begun
            "def burn(s):\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < s: pass\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    burn(0.6); os._exit(0)\n"
            "burn(0.3); os.waitpid(pid, 0); time.sleep(0.5)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    watch = measure.TreeWatch(proc.pid, cpu_interval_s=0.05, discover_interval_s=0.05,
                              pss_interval_s=0.1).start()
    watch.mark("begin")
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    proc.wait()
    watch.mark("end")
    watch.stop()
    assert len(watch.known_pids()) >= 2
    # 0.9 s burnt in two processes inside the window, less up to a reading interval of the
    # child's last work (it exits between readings; a loaded machine reads later).
    assert watch.cpu_between("begin", "end") >= 0.7
    assert watch.peak_pss_mb > 0


def test_check_batch_names_the_problem():
    img = np.zeros((4, 224, 224, 3), np.uint8)
    assert check_batch(img, np.zeros(4), (224, 224, 3)) == (4, None)
    assert check_batch(img, np.zeros(3), (224, 224, 3))[1] == "3 labels for 4 images"
    assert "dtype float32" in check_batch(img.astype(np.float32), np.zeros(4), (224, 224, 3))[1]
    assert "expected (n, 256, 256, 3)" in check_batch(img, np.zeros(4), (256, 256, 3))[1]


def test_steady_excludes_the_cold_epoch():
    ep = [{"rows": 100, "end_s": 5.0}, {"rows": 100, "end_s": 6.0}, {"rows": 100, "end_s": 7.0}]
    assert steady(ep) == pytest.approx(100.0)
    assert steady(ep[:1]) is None


def test_config_rejects_bad_arguments():
    with pytest.raises(ConfigError, match=r"--peers takes a comma list of L, L-crop, pyarrow"):
        run.config_from_args(argparse.Namespace(peers="torch,keras"))
    with pytest.raises(ConfigError, match=r"--epochs must be >= 2 \(one cold epoch"):
        run.config_from_args(argparse.Namespace(epochs=1))
    cfg = run.config_from_args(argparse.Namespace(quick=True))
    assert cfg.rounds == 1 and cfg.epochs == 2 and cfg.isolate == "peer"
    # 0 is a value (no sleep, no work), not "take the default"; below 0 is refused.
    cfg = run.config_from_args(argparse.Namespace(quick=True, sleep_ms=0, work_ms=0))
    assert (cfg.sleep_ms_per_image, cfg.work_ms_per_image) == (0.0, 0.0)
    for bad, pattern in (({"sleep_ms": -5}, r"--sleep-ms must be 0 or more, got -5"),
                         ({"timeout": 0}, r"--timeout must be above 0, got 0"),
                         ({"work_kb_per_image": -2}, r"--work-kb-per-image must be 0 or more")):
        with pytest.raises(ConfigError, match=pattern):
            run.config_from_args(argparse.Namespace(quick=True, **bad))


def test_quick_plans_the_train_peers_on_one_folder_and_one_parquet_workload():
    """--quick checks that every arm runs: a Train peer (a TorchTrainer start per cell) runs
    the iterate mode, raying's on W1 and W3 (Parquet shards through Train), plain Ray Data's
    on W1; a full run plans every workload and mode it has."""
    quick = run.config_from_args(argparse.Namespace(quick=True))
    full = run.config_from_args(argparse.Namespace(rounds=1))
    for peer, planned in (("raying-train", [("W1", "iterate"), ("W3", "iterate")]),
                          ("raydata-train", [("W1", "iterate")])):
        jobs = [j for j in run.plan_jobs(quick)[0] if j.peer == peer]
        assert [(c["workload"], c["mode"]) for j in jobs for c in j.cells] == planned
        jobs = [j for j in run.plan_jobs(full)[0] if j.peer == peer]
        assert {c["workload"] for j in jobs for c in j.cells} == set(PEER_WORKLOADS[peer])
        assert {c["mode"] for j in jobs for c in j.cells} == set(full.modes)
    raying_cells = [c for j in run.plan_jobs(quick)[0] if j.peer == "raying" for c in j.cells]
    assert {c["workload"] for c in raying_cells} == set(PEER_WORKLOADS["raying"])


def test_plan_interleaves_and_rotates_peers():
    cfg = run.config_from_args(argparse.Namespace(rounds=2, workloads="W1",
                                                  peers="L,torch,raying", modes="iterate"))
    rounds = run.plan_jobs(cfg)
    assert [j.peer for j in rounds[0]] == ["L", "torch", "raying"]
    assert [j.peer for j in rounds[1]] == ["torch", "raying", "L"]
    assert all(c["mode"] == "iterate" for j in rounds[0] for c in j.cells)


def test_plan_pairs_prioritized_with_uniform_cells():
    cfg = run.config_from_args(argparse.Namespace(workloads="W1,W5", peers="torch,raying",
                                                  modes="iterate,sleep", batch_sizes="64"))
    jobs = run.plan_jobs(cfg)[0]
    assert [j.tag for j in jobs] == ["r0-torch-W1", "r0-raying-W1+W5"]
    assert [(c["workload"], c["mode"]) for c in jobs[1].cells] == [
        ("W1", "iterate"), ("W5", "iterate"), ("W1", "sleep"), ("W5", "sleep")]
    cfg = run.config_from_args(argparse.Namespace(workloads="W1,W5", peers="raying", rounds=2,
                                                  modes="iterate,sleep", batch_sizes="64"))
    second = run.plan_jobs(cfg)[1][0]  # W1 first in every round: its cold figures are fresh
    assert [(c["workload"], c["mode"]) for c in second.cells] == [
        ("W1", "iterate"), ("W5", "iterate"), ("W1", "sleep"), ("W5", "sleep")]


def test_combine_medians_and_ratios():
    wl = {"W1": {"rows": 10, "decoded": None}}

    def cell(rate_s: float) -> dict:
        return {"workload": "W1", "batch_size": 64, "mode": "iterate", "setup_s": 0.1,
                "cpu_steady_s": 1.0, "peak_pss_mb": 100.0, "errors": [],
                "epochs": [{"rows": 10, "problems": [], "request_s": 0.0, "first_s": 0.5,
                            "end_s": 1.0, "ttfb_s": 0.5},
                           {"rows": 10, "problems": [], "request_s": 1.0, "first_s": 1.1,
                            "end_s": 1.0 + rate_s, "ttfb_s": 0.1}]}

    runs = [{"peer": "L", "round": 0, "cells": [cell(0.5)]},
            {"peer": "torch", "round": 0, "cells": [cell(1.0)]},
            {"peer": "torch", "round": 1, "cells": [cell(2.0)]},
            {"peer": "torch", "round": 2, "cells": [cell(0.25)]}]
    rows = aggregate.combine(runs, wl, epochs=2)
    torch = next(r for r in rows if r["peer"] == "torch")
    assert torch["rows_ok"] and torch["rounds"] == 3
    assert torch["steady_img_s"] == pytest.approx(10.0)  # median of 5, 10, 40
    assert torch["ratio_to_L"] == pytest.approx(0.5)
    assert torch["cpu_s_per_1k"] == pytest.approx(100.0)
    assert torch["cold_img_s"] == pytest.approx(10.0)  # 10 rows by the end of epoch 0, 1 s
    assert torch["job_1_s"] == pytest.approx(1.0)


def _cell(w: str, rate_s: float) -> dict:
    """A cell of 10 rows per epoch: epoch 0 in 1 s, epoch 1 in ``rate_s``."""
    return {"workload": w, "batch_size": 64, "mode": "iterate", "setup_s": 0.1,
            "cpu_steady_s": 1.0, "peak_pss_mb": 100.0, "errors": [],
            "epochs": [{"rows": 10, "problems": [], "request_s": 0.0, "first_s": 0.5,
                        "end_s": 1.0, "ttfb_s": 0.5},
                       {"rows": 10, "problems": [], "request_s": 1.0, "first_s": 1.1,
                        "end_s": 1.0 + rate_s, "ttfb_s": 0.1}]}


def test_prioritized_over_uniform_pairs_each_round():
    """W5 / W1 is the median of each round's own ratio (the two ran back to back), not the
    ratio of the two medians: a slow round slows both arms and cancels out."""
    wl = {"W1": {"rows": 10, "decoded": None}, "W5": {"rows": 10, "decoded": None}}

    # steady img/s per round: W1 10 / 5 / 2.5, W5 9.5 / 4.75 / 2.5 (0.95, 0.95, 1.0 each)
    runs = [{"peer": "raying", "round": 0, "cells": [_cell("W1", 1.0), _cell("W5", 1 / 0.95)]},
            {"peer": "raying", "round": 1, "cells": [_cell("W5", 2 / 0.95), _cell("W1", 2.0)]},
            {"peer": "raying", "round": 2, "cells": [_cell("W1", 4.0), _cell("W5", 4.0)]}]
    rows = aggregate.combine(runs, wl, epochs=2)
    w5 = next(r for r in rows if r["workload"] == "W5")
    assert w5["ratio_to_uniform"] == pytest.approx(0.95)
    assert w5["ratio_of_medians_to_uniform"] == pytest.approx(4.75 / 5.0)
    runs[2]["cells"] = [_cell("W1", 1.0), _cell("W5", 4.0)]  # one slow W5 round: 0.25
    runs[0]["cells"] = [_cell("W1", 4.0), _cell("W5", 1 / 0.95)]  # and a slow W1 one: 3.8
    w5 = next(r for r in aggregate.combine(runs, wl, epochs=2) if r["workload"] == "W5")
    assert w5["ratio_to_uniform"] == pytest.approx(0.95)  # the median of 3.8, 0.95, 0.25


def test_a_cache_row_is_labelled_not_anyone_s_best_peer():
    wl = {"W1": {"rows": 10, "decoded": None}}

    def cell(cold_s: float, rate_s: float) -> dict:
        return {"workload": "W1", "batch_size": 64, "mode": "iterate", "setup_s": 0.1,
                "cpu_steady_s": 1.0, "peak_pss_mb": 100.0, "peak_whole_mb": 300.0,
                "errors": [],
                "epochs": [{"rows": 10, "problems": [], "request_s": 0.0, "first_s": 0.5,
                            "end_s": cold_s, "ttfb_s": 0.5},
                           {"rows": 10, "problems": [], "request_s": cold_s,
                            "first_s": cold_s + 0.1, "end_s": cold_s + rate_s, "ttfb_s": 0.1}]}

    runs = [{"peer": "torch", "round": 0, "cells": [cell(1.0, 1.0)], "startup_whole_mb": 50.0},
            {"peer": "raying", "round": 0, "cells": [cell(0.5, 0.5)],
             "startup_whole_mb": 200.0},
            {"peer": "raying-cache", "round": 0, "cells": [cell(2.0, 0.1)],
             "startup_whole_mb": 200.0}]
    rows = aggregate.combine(runs, wl, epochs=2)
    by = {r["peer"]: r for r in rows}
    assert by["torch"]["best_peer"] == "raying"  # not the cache row, though it is faster
    assert by["raying"]["best_peer"] == "torch" and by["raying"]["ratio_to_best_peer"] == 2.0
    assert by["raying"]["cold_ratio_to_best_peer"] == pytest.approx(2.0)
    assert by["raying"]["beyond_start_mb"] == pytest.approx(100.0)
    checks = {c["target"]: c for c in aggregate.targets(rows)}
    cache = checks["W1 b64: epoch 0 with the decoded cache / without (paired by round)"]
    assert cache["value"] == pytest.approx(0.25) and cache["pass"] is False
    mem = checks["W1 b64: raying whole memory beyond Ray's floor / torch whole"]
    assert mem["value"] == pytest.approx(100.0 / 300.0) and mem["pass"] is True
    # Paired by round: each round's cache cell against the uncached cell beside it. Epoch 0
    # (cold, start-up included) in s, uncached 1 / 1 / 2, cached 1.02 / 2.04 / 2.04: the
    # medians are rounds apart (1 against 2.04 s), the pairs 0.98 / 0.49 / 0.98.
    runs = []
    for k, (off, on) in enumerate([(1.0, 1.02), (1.0, 2.04), (2.0, 2.04)]):
        runs += [{"peer": "raying", "round": k, "cells": [cell(off, 0.5)]},
                 {"peer": "raying-cache", "round": k, "cells": [cell(on, 0.5)]}]
    checks = {c["target"]: c for c in aggregate.targets(aggregate.combine(runs, wl, epochs=2))}
    cache = checks["W1 b64: epoch 0 with the decoded cache / without (paired by round)"]
    assert cache["value"] == pytest.approx(1 / 1.02) and cache["pass"] is True
    assert cache["detail"] == f"3 rounds paired; ratio of medians {1 / 2.04:.3f}"


def test_a_target_above_the_crop_window_kernel_s_own_rate_is_marked_unreachable():
    """L-crop is a reference, nobody's best peer; a ratio target asking raying for more img/s
    than L-crop's steady rate is marked unreachable, one within it reachable."""
    wl = {"W1": {"rows": 10, "decoded": None}, "W2": {"rows": 10, "decoded": None}}

    # Steady img/s: tf 10 on both; L-crop 20 on W1 (1.15 x 10 fits), 11 on W2 (it does not).
    runs = [{"peer": "tf", "round": 0, "cells": [_cell("W1", 1.0), _cell("W2", 1.0)]},
            {"peer": "raying", "round": 0, "cells": [_cell("W1", 0.8), _cell("W2", 0.8)]},
            {"peer": "L-crop", "round": 0, "cells": [_cell("W1", 0.5), _cell("W2", 1 / 1.1)]}]
    rows = aggregate.combine(runs, wl, epochs=2)
    assert all(r["best_peer"] == "tf" for r in rows if r["peer"] == "raying")
    checks = {c["target"]: c for c in aggregate.targets(rows)}
    w1 = checks["W1 b64: raying steady / best of torch, tf"]
    w2 = checks["W2 b64: raying steady / best of torch, tf"]
    assert w1["reachable"] is True and w2["reachable"] is False
    assert "needs 12 img/s, L-crop 11" in w2["detail"]
    assert report.targets_table([w2]).endswith("ABOVE THE CEILING")
    assert "ABOVE" not in report.targets_table([w1])
    by = {(r["workload"], r["peer"]): r for r in rows}
    assert by[("W2", "raying")]["ratio_to_L_crop"] == pytest.approx(12.5 / 11)


def test_the_train_path_is_held_against_the_iterator_and_ray_data_through_train():
    wl = {"W1": {"rows": 10, "decoded": None}}

    def cell(rate_s: float) -> dict:
        return {"workload": "W1", "batch_size": 64, "mode": "iterate", "setup_s": 0.1,
                "cpu_steady_s": 1.0, "peak_pss_mb": 100.0, "peak_whole_mb": 300.0,
                "errors": [],
                "epochs": [{"rows": 10, "problems": [], "request_s": 0.0, "first_s": 0.5,
                            "end_s": 1.0, "ttfb_s": 0.5},
                           {"rows": 10, "problems": [], "request_s": 1.0, "first_s": 1.1,
                            "end_s": 1.0 + rate_s, "ttfb_s": 0.1}]}

    runs = [{"peer": "raying", "round": 0, "cells": [cell(1.0)]},
            {"peer": "raying-train", "round": 0, "cells": [cell(1.25)]},
            {"peer": "raydata-train", "round": 0, "cells": [cell(2.0)]}]
    rows = aggregate.combine(runs, wl, epochs=2)
    checks = {c["target"]: c for c in aggregate.targets(rows)}
    vs_iter = checks["W1 b64: Ray Train path steady / raying iterator (paired by round)"]
    assert vs_iter["value"] == pytest.approx(0.8) and vs_iter["pass"] is False
    vs_rd = checks["W1 b64: Ray Train path steady / Ray Data through Train"]
    assert vs_rd["value"] == pytest.approx(1.6) and vs_rd["pass"] is True
    # Each round's Train cell against the iterator's of the same round (a slow round slows
    # both): steady s, iterator 1 / 1 / 2, Train 1.05 / 2.1 / 2.1; pairs 0.95 / 0.48 / 0.95,
    # medians rounds apart (1 against 2.1 s).
    runs = []
    for k, (it, tr) in enumerate([(1.0, 1.05), (1.0, 2.1), (2.0, 2.1)]):
        runs += [{"peer": "raying", "round": k, "cells": [cell(it)]},
                 {"peer": "raying-train", "round": k, "cells": [cell(tr)]}]
    checks = {c["target"]: c for c in aggregate.targets(aggregate.combine(runs, wl, epochs=2))}
    vs_iter = checks["W1 b64: Ray Train path steady / raying iterator (paired by round)"]
    assert vs_iter["value"] == pytest.approx(1 / 1.05) and vs_iter["pass"] is True
    assert vs_iter["detail"] == f"3 rounds paired; ratio of medians {1 / 2.1:.3f}"


# -- the quick bench, end to end ------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out, data = root / "out", root / "data"
    t0 = time.monotonic()
    # As inside a Ray job (jobs/bench.py submitted): Ray gives the entrypoint the job's config,
    # whose working_dir package only the job's cluster holds; the peers' own local Rays must
    # not inherit it.
    job = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"},
           "metadata": {}}
    env = dict(os.environ, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job))
    res = subprocess.run([sys.executable, "-m", "raying.tools.cli", "bench", "--quick", "--out",
                          str(out), "--data", str(data)], capture_output=True, text=True,
                         timeout=1500, env=env)
    print(f"quick bench: {time.monotonic() - t0:.0f} s\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}")
    with open(out / "bench.json") as fh:
        doc = json.load(fh)
    return res, doc, out


@pytest.mark.timeout(1800)
def test_quick_bench_every_peer_runs_and_counts_rows(quick_bench):
    res, doc, out = quick_bench
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = doc["results"]
    expected_epochs = doc["config"]["epochs"]
    seen = {(r["workload"], r["peer"]) for r in rows}
    for peer in PEER_WORKLOADS:
        for wl in peer_workloads(peer, quick=True):
            assert (wl, peer) in seen, f"{peer} did not run {wl}"
    for r in rows:
        where = f"{r['workload']} {r['peer']} b{r['batch_size']} {r['mode']}"
        assert r["rows_ok"], (where, r["rows_per_epoch"], r["problems"])
        for per_round in r["rows_per_epoch"]:
            assert per_round == [doc["workloads"][r["workload"]]["rows"]] * expected_epochs, where
        assert r["steady_img_s"] is not None and r["steady_img_s"] > 0, where
        assert r["cpu_s_per_1k"] is not None and r["peak_pss_mb"] is not None, where
        assert r["cold_img_s"] and r["peak_whole_mb"] and len(r["job_s"]) == expected_epochs, where
        if r["peer"] in ("raydata", "raying", "raying-cache", "raying-train", "raydata-train"):
            assert r["ray_start_s"] is not None, where
        if r["peer"] == "raying":
            assert r["read_worker_mb_max"] and r["read_worker_mb_max"] > 20, where
    # A non-iterate consumer mode ran for the loaders on the first workload.
    assert {r["mode"] for r in rows if r["workload"] == "W1"} == {"iterate", "compute"}
    assert any(r["workload"] == "W4" and r["gb_s"] for r in rows)
    assert doc["targets"] and doc["definitions"]
    # raying's modules ran from bytecode, as an installed package's do (not compiled again by
    # every Ray worker inside raying's cold epoch).
    assert doc["host"]["raying_bytecode"] == "compiled"
    assert os.path.exists(importlib.util.cache_from_source(read_task.__file__))
    assert all(not run_["leftover_pids"] for run_ in doc["runs"])
    assert os.path.getsize(out / "bench.png") > 10_000
    assert "speed targets: not judged in --quick" in res.stdout  # tiny sizes: no verdicts


def test_first_touch_counts_new_ids_per_epoch(image_folder, ray_local):
    """Uniform epochs are permutations: every id is new in epoch 0 and never after; prioritized
    draws repeat ids (here 90 draws an epoch over 60 ids), and each id counts as new once, in
    the epoch that first drew it."""
    import raying
    from raying.bench.first_touch import first_touches

    m = raying.Manifest.scan(str(image_folder))
    n = len(m)
    transform = raying.ImageTransform(size=32)
    pipe = raying.Pipeline(m, transform=transform)
    rows = first_touches(pipe, n, epochs=2, batch_size=16, report=False)
    pipe.close()
    assert [(r["draws"], r["distinct"], r["first_touches"]) for r in rows] == [(n, n, n),
                                                                                (n, n, 0)]
    draws = int(1.5 * n)
    pipe = raying.Pipeline(m, transform=transform,
                           sampler=raying.PrioritizedSampler(seed=0, samples_per_epoch=draws))
    rows = first_touches(pipe, n, epochs=3, batch_size=16, report=True)
    pipe.close()
    assert rows[0]["first_touches"] == rows[0]["distinct"] < draws  # with replacement: repeats
    assert sum(r["first_touches"] for r in rows) <= n
    assert all(r["draws"] == draws and r["first_touches"] <= r["distinct"] < draws
               for r in rows)
