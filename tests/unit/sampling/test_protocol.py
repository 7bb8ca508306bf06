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
    saved = raying.Pipeline(folder, sampler=raying.UniformSampler(seed=3, window_row_groups=4)
                            ).state_dict()
    other = raying.Pipeline(folder, sampler=raying.UniformSampler(seed=3, window_row_groups=1))
    other.load_state_dict(saved)  # a folder's plans do not depend on the window
    raying.UniformSampler(seed=3).load_state_dict({"sampler": "uniform", "seed": 3})  # older


def test_a_prioritized_state_of_other_table_settings_is_refused_naming_the_arguments():
    """The saved table's settings are checked by the sampler, before any store is touched,
    in the sampler's own arguments (the table's message offered a strict=False that no
    public call takes); beta may change between checkpoints (a schedule)."""
    import dataclasses

    def state_of(**kw):
        config = dataclasses.asdict(raying.PrioritizedSampler(**kw).table_config)
        return {"sampler": "prioritized", "seed": 0, "alpha": kw.get("alpha", 1.0),
                "tables": [{"config": config}]}

    s = raying.PrioritizedSampler(alpha=1.0, beta=0.4)
    with pytest.raises(raying.ConfigError, match=r"saved by a PrioritizedSampler with "
                                                 r"\{'alpha': 0.6\}; this pipeline's has "
                                                 r"\{'alpha': 1.0\}.*PrioritizedSampler\("
                                                 r"alpha=0.6, \.\.\.\)"):
        s.load_state_dict(state_of(alpha=0.6))
    with pytest.raises(raying.ConfigError, match=r"table=\{'age_after': 5\}"):
        s.load_state_dict(state_of(alpha=1.0, table={"age_after": 5}))
    with pytest.raises(raying.ConfigError, match=r"PrioritizedSampler\(guard=True, table="
                                                 r"\{'guard_after': \d+\}, \.\.\.\)"):
        s.load_state_dict(state_of(alpha=1.0, guard=True))
    s._check_table_settings(state_of(alpha=1.0, beta=0.9)["tables"][0]["config"])
    with pytest.raises(raying.ConfigError, match=r"\{'alpha': 0.6\}"):  # saved before a store
        s.load_state_dict({**state_of(alpha=0.6), "tables": None})
