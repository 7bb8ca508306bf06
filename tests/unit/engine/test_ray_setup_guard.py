"""A pipeline's reader thread never starts a Ray of its own (Ray's auto-init) after the
training thread shut Ray down; other threads keep Ray's behaviour."""

from __future__ import annotations

import threading

import pytest

from raying.engine import ray_setup
from raying.engine.ray_setup import no_auto_init
from raying.errors import ConfigError


def test_a_reader_thread_refuses_ray_s_auto_init_once_ray_is_down():
    import ray
    from ray._private import auto_init_hook as hook

    if ray.is_initialized():
        pytest.skip("a Ray is up in this process")
    flags = []
    with no_auto_init():
        with pytest.raises(ConfigError, match="does not start a new one"):
            hook.auto_init_ray()  # what ray.get and ray.wait call first
        # Another thread meanwhile is not a reader: Ray's auto-init stays its own there.
        t = threading.Thread(target=lambda: flags.append(getattr(ray_setup._reader, "on",
                                                                 False)))
        t.start()
        t.join()
    assert flags == [False]
    assert getattr(ray_setup._reader, "on", False) is False  # left as it was
    assert getattr(hook.auto_init_ray, "_raying_guard", False)
