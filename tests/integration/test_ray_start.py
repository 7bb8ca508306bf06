"""The local Ray raying starts: its workers import the read path as they start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = """
import sys, time
from raying.engine.ray_setup import ensure_ray
import ray
ensure_ray()
@ray.remote
def modules():
    import sys
    return [m in sys.modules for m in ("raying.engine.preload", "raying.read.task", "pyarrow")]
@ray.remote
def blas_threads():
    import ctypes, glob, os, numpy
    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "numpy.libs",
                                  "libscipy_openblas*"))
    if not libs:
        return None
    lib = ctypes.CDLL(libs[0])
    return lib.scipy_openblas_get_num_threads64_()
print("blas", ray.get(blas_threads.remote()))
print(ray.get(modules.remote()))
ray.shutdown()
"""


@pytest.mark.parametrize(("preload", "expected"), [("1", "[True, True, True]"),
                                                   ("0", "[False, False")])
def test_a_ray_raying_starts_preloads_the_read_path_in_its_workers(preload, expected):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_preload_python_modules")}
    env["RAYING_PRELOAD_WORKERS"] = preload
    env.pop("OPENBLAS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith(expected), out.stdout[-2000:]
    # numpy's BLAS on one thread in a read worker, preloaded or not (not one per core: the
    # node's workers would oversubscribe it), as when numpy is imported inside the task.
    blas = next(ln for ln in lines if ln.startswith("blas"))
    assert blas in ("blas 1", "blas None"), out.stdout[-2000:]
