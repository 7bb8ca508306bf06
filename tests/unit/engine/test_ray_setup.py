"""Attaching to RAY_ADDRESS: addresses a driver cannot use are refused before ray.init waits."""

from __future__ import annotations

import socket

import pytest

from raying.engine.ray_setup import check_ray_address
from raying.errors import ConfigError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_job_api_s_http_address_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"job API's HTTP address .* host:port \(6379 .*6380 for `raying cluster start`'s"):
        check_ray_address("http://127.0.0.1:8265")


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_a_head_that_is_down_is_a_connection_error_naming_the_address(form):
    address = form.format(port=_closed_port())
    with pytest.raises(ConnectionError, match=rf"could not connect to Ray at {address} "
                                              r"\(RAY_ADDRESS\).*start it"):
        check_ray_address(address, timeout_s=5.0)


def test_a_listening_head_and_ray_s_own_forms_pass():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
        check_ray_address(f"ray://127.0.0.1:{server.getsockname()[1]}")
    for address in ("auto", "local", "head-without-port"):
        check_ray_address(address)


def test_ray_start_settings_preload_and_prompt_frees_unless_turned_off_or_set_by_the_user(monkeypatch):
    from raying.engine import ray_setup
    from raying.options import Settings, settings, use

    monkeypatch.delenv(ray_setup.PRELOAD_ENV, raising=False)
    before = settings()
    try:
        _preload_cases(ray_setup, Settings, use, monkeypatch)
    finally:
        use(before)


def _preload_cases(ray_setup, Settings, use, monkeypatch):
    monkeypatch.delenv(ray_setup.FREE_PERIOD_ENV, raising=False)
    free = {"free_objects_period_milliseconds": 0}
    use(Settings())
    assert ray_setup.preload_env() == {ray_setup.PRELOAD_ENV: "raying.engine.preload"}
    assert ray_setup.local_ray_kwargs() == {
        "_system_config": {**free, "preload_python_modules": ["raying.engine.preload"]}}
    assert ray_setup.cluster_env() == {ray_setup.PRELOAD_ENV: "raying.engine.preload",
                                       ray_setup.FREE_PERIOD_ENV: "100"}
    use(Settings(preload_workers=0))
    assert ray_setup.preload_env() == {}
    assert ray_setup.local_ray_kwargs() == {"_system_config": free}
    assert ray_setup.cluster_env() == {ray_setup.FREE_PERIOD_ENV: "100"}
    use(Settings())
    monkeypatch.setenv(ray_setup.PRELOAD_ENV, "mymodule")  # the user's own: left to Ray
    monkeypatch.setenv(ray_setup.FREE_PERIOD_ENV, "500")
    assert ray_setup.preload_env() == {} and ray_setup.local_ray_kwargs() == {}
    assert ray_setup.cluster_env() == {}


def test_the_preload_module_imports_the_read_path():
    import subprocess
    import sys

    code = ("import sys; import raying.engine.preload; "
            "print(all(m in sys.modules for m in ('numpy', 'pyarrow', 'raying.read.task', "
            "'raying.image.decode', 'raying.engine.stream')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
