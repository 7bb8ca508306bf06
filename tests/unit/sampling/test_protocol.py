"""Both samplers implement the Sampler protocol the Pipeline relies on; others are refused."""

from __future__ import annotations

import pytest

import raying
from raying.sampling.protocol import Sampler


def test_the_samplers_implement_the_protocol():
    assert isinstance(raying.UniformSampler(seed=3), Sampler)
    assert isinstance(raying.PrioritizedSampler(seed=3), Sampler)


def test_a_uniform_sampler_answers_every_protocol_call_without_a_store():
    s = raying.UniformSampler(seed=3)
    assert (s.lazy, s.handle, s.store_name, s.samples_per_epoch) == (False, None, None, None)
    s.set_aside([1, 2])
    s.flush()
    s.report([1], [0.5])
    assert s.state_dict() == {"sampler": "uniform", "seed": 3, "shuffle": True,
                              "window_row_groups": s.window_row_groups}


def test_a_pipeline_refuses_what_is_not_a_sampler(tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=4, classes=2, size=(8, 8))
    with pytest.raises(raying.ConfigError, match=r"Pipeline\(sampler=...\) must be a raying "
                                                 r"sampler .* got list"):
        raying.Pipeline(raying.Manifest.scan(str(root)), sampler=[1, 2])


def test_a_uniform_sampler_refuses_another_sampler_s_state():
    s = raying.UniformSampler(seed=3)
    s.load_state_dict({"sampler": "uniform", "seed": 3})
    for other in ({"sampler": "weighted", "seed": 3}, {"sampler": "prioritized", "seed": 3}):
        with pytest.raises(raying.ConfigError, match=rf"saved by a '{other['sampler']}' "
                                                     r"sampler; this pipeline has Uniform"):
            s.load_state_dict(other)



def test_a_uniform_sampler_refuses_a_state_of_another_order_or_window(tmp_path):
    """shuffle and (for Parquet) window_row_groups make another plan: a saved position in
    it would repeat or skip rows. A folder's plan does not depend on the window."""
    from raying.tools.datagen import make_image_folder

    s = raying.UniformSampler(seed=3, window_row_groups=4)
    with pytest.raises(raying.ConfigError, match=r"saved with UniformSampler\(shuffle=True\) "
                                                 r"but this pipeline has shuffle=False"):
        raying.UniformSampler(seed=3, shuffle=False, window_row_groups=4).load_state_dict(
            s.state_dict())
    with pytest.raises(raying.ConfigError, match=r"window_row_groups=4\) but this pipeline "
                                                 r"has window_row_groups=1 .*RAYING_PARQUET"):
        raying.UniformSampler(seed=3, window_row_groups=1).load_state_dict(s.state_dict())
    folder = raying.Manifest.scan(str(make_image_folder(tmp_path / "imgs", n=4, classes=2,
                                                        size=(8, 8))))
    t = raying.UniformSampler(seed=3, window_row_groups=1)
    t.bind(folder, name="t")
    t.load_state_dict(s.state_dict())  # a folder: the window does not matter
    raying.UniformSampler(seed=3).load_state_dict({"sampler": "uniform", "seed": 3})  # older
