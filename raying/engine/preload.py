"""What a read task needs, imported by Ray's workers as they start (before any task).

A local Ray that raying starts (:func:`raying.engine.ray_setup.ensure_ray`), and the nodes of
``raying cluster start``, name this module in Ray's ``preload_python_modules``: every worker
process imports it when it starts, while the driver lists its dataset and builds its model,
instead of inside the first read task of the first epoch (numpy, pyarrow, the decoders and
raying's read path: ~0.17 s of CPU per worker here, most of a cold epoch's first-task
delay). It is the counterpart of a DataLoader's forked workers, which inherit the modules of
the process that forked them. Workers that never run a read task (actors, trainers) pay the
imports too: ~5 MB of memory each beyond what the node's shared libraries already hold.
"""

from __future__ import annotations

import contextlib

import numpy  # noqa: F401
import pyarrow  # noqa: F401
import pyarrow.parquet  # noqa: F401

import raying.engine.stream  # noqa: F401 - the read task and everything it imports
import raying.image.decode  # noqa: F401

# The decoders are optional extras: a node without them decodes with what it has.
for _name in ("simplejpeg", "cv2"):
    with contextlib.suppress(ImportError):
        __import__(_name)
