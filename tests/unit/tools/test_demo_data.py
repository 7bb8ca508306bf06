"""The demo's generated dataset: written once, whole, even by two first runs at once."""

from __future__ import annotations

import multiprocessing as mp
import os

from raying.tools.demo_data import DemoDataSpec, ensure_demo_data

SPEC = DemoDataSpec(common_per_class=3, rare_per_class=1, val_per_class=1, size=16, seed=3)


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def _generate(base, out):
    data = ensure_demo_data(base, SPEC)
    out.put((str(data.root), data.generated))


def test_two_first_runs_at_once_each_get_the_whole_dataset(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_generate, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    roots = {root for root, _ in got}
    assert len(roots) == 1
    # Only the runs whose folder was renamed into place say they generated it; all see it.
    assert sum(generated for _, generated in got) >= 1
    assert sorted(os.listdir(tmp_path)) == [".lock", os.path.basename(roots.pop())]  # no work folder
    alone = ensure_demo_data(tmp_path / "alone", SPEC)
    assert _files(alone.root) == _files(ensure_demo_data(tmp_path, SPEC).root)
    again = ensure_demo_data(tmp_path, SPEC)
    assert not again.generated and again.bad_paths == alone.bad_paths
    assert sum(1 for f in _files(again.train) if f.endswith(".jpg")) == 7 * 3 + 3 * 1 + 3


def test_an_interrupted_folder_is_generated_again(tmp_path):
    first = ensure_demo_data(tmp_path, SPEC)
    (first.root / "spec.json").unlink()  # as if the run had stopped before its last write
    (first.train / "class_00" / "00000.jpg").unlink()
    again = ensure_demo_data(tmp_path, SPEC)
    assert again.generated and (again.train / "class_00" / "00000.jpg").exists()
    assert (again.root / "spec.json").exists()


def test_an_unwritable_folder_names_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    try:
        ensure_demo_data(blocker / "sub", SPEC)
    except Exception as exc:  # noqa: BLE001 - the type is checked below
        assert type(exc).__name__ == "ConfigError" and "--data" in str(exc)
    else:
        raise AssertionError("expected a ConfigError")


def test_a_work_folder_left_by_a_killed_run_is_removed_later(tmp_path):
    first = ensure_demo_data(tmp_path / "x", SPEC)  # the name its work folders take
    stale = tmp_path / f".{first.root.name}.killed"
    fresh = tmp_path / f".{first.root.name}.running"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (0, 0))
    ensure_demo_data(tmp_path, SPEC)
    assert not stale.exists() and fresh.exists()  # a run still writing keeps its folder
