"""What a read task needs, imported by Ray's workers as they start (before any task).

A local Ray that raying starts (:func:`raying.engine.ray_setup.ensure_ray`), and the nodes of
``raying cluster start``, name this module in Ray's ``preload_python_modules``: every worker
process imports it when it starts, while the driver lists its dataset and builds its model,
instead of inside the first read task of the first epoch (numpy, pyarrow, the decoders and
raying's read path: ~0.17 s of CPU per worker here, most of a cold epoch's first-task
delay). It is the counterpart of a DataLoader's forked workers, which inherit the modules of
the process that forked them. Workers that never run a read task (actors, trainers) pay the
imports too: ~5 MB of memory each beyond what the node's shared libraries already hold, and
their numpy runs its BLAS on one thread (below); ``RAYING_PRELOAD_WORKERS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os

# numpy's OpenBLAS sizes its thread pool from the environment when numpy is first imported.
# Imported inside a task, it sees the OMP_NUM_THREADS Ray sets for that task (1 for a read
# task); imported here, before any task, it would take every core of the node, and each of a
# node's read workers would run that many BLAS threads (a user stage's matrix products then
# compete across workers). One thread, as a read task has one CPU; the variable is put back,
# so what Ray sets for a task's other libraries (torch's OMP_NUM_THREADS) is unchanged.
_BLAS = "OPENBLAS_NUM_THREADS"
_unset = _BLAS not in os.environ
if _unset:
    os.environ[_BLAS] = "1"
try:
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import raying.engine.stream  # noqa: F401 - the read task and everything it imports
    import raying.image.decode  # noqa: F401
finally:
    if _unset:
        del os.environ[_BLAS]

# The decoders are optional extras: a node without them decodes with what it has.
for _name in ("simplejpeg", "cv2"):
    with contextlib.suppress(ImportError):
        __import__(_name)

# Ray makes a worker's serialization context (it imports pydantic, ~0.05 s here) when the
# worker deserializes its first task's arguments: made here, the first read task of a cold
# epoch starts ~0.01 s after it is submitted instead of ~0.06 s.
from raying.engine.ray_setup import warm_serializer  # noqa: E402

SERIALIZER_READY = warm_serializer()
