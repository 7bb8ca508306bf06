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
    with pytest.raises(ConfigError, match=r"job API's HTTP address .* host:6379"):
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
