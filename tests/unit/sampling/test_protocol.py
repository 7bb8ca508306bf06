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
    assert s.state_dict() == {"sampler": "uniform", "seed": 3}


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

