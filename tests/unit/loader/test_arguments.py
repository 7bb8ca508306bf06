"""Pipeline's arguments refused by name when they cannot work."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raying
from raying.tools.datagen import encode


@pytest.mark.parametrize(("arg", "cls"), [("sampler", raying.UniformSampler),
                                          ("sampler", raying.PrioritizedSampler),
                                          ("transform", raying.ImageTransform),
                                          ("config", raying.PipelineConfig)])
def test_a_class_given_for_an_object_is_refused_by_name(tmp_path, arg, cls):
    """`sampler=raying.UniformSampler` (no parentheses) was taken, and failed at the first
    read with a bare TypeError (a transform's inside Ray's read tasks, retried)."""
    img = encode(np.zeros((4, 4, 3), np.uint8), "png")
    pq.write_table(pa.table({"image": [img] * 4, "label": [0, 1] * 2}), tmp_path / "p.parquet")
    m = raying.Manifest.scan(str(tmp_path))
    with pytest.raises(raying.ConfigError, match=rf"Pipeline\({arg}=\.\.\.\) got the class "
                                                 rf"{cls.__name__}, not one of its objects: "
                                                 rf"pass {arg}={cls.__name__}\(\.\.\.\)"):
        raying.Pipeline(m, **{arg: cls})
