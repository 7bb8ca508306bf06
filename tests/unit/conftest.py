"""Unit tests run without a cluster: any attempt to start Ray fails fast."""

import pytest


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    try:
        import ray
    except ImportError:  # pragma: no cover
        return

    def _refuse(*args, **kwargs):
        raise RuntimeError("unit tests must not start Ray; move this test to tests/integration")

    monkeypatch.setattr(ray, "init", _refuse)
