"""The viewer's server: the listening socket and uvicorn, in this process."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import pytest

from tensorkv.errors import ConfigError
from tensorkv.viewer.web import server


def test_uvicorn_serves_the_app_and_stops(ckpt):
    from tensorkv.viewer.web.app import create_app

    sock = server.listen("127.0.0.1", 0)
    base = server.bound_url(sock)
    assert base.startswith("http://127.0.0.1:")
    ready = threading.Event()
    srv = server.make_server(create_app(ckpt["url"]), on_ready=ready.set)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        with urllib.request.urlopen(base + "api/tags", timeout=30) as resp:
            assert [t["tag"] for t in json.loads(resp.read())["tags"]] == ["t1", "t2"]
            assert "server" not in resp.headers  # no version banner
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()


def test_listen_errors_name_the_fix():
    with pytest.raises(ConfigError, match="out of range"):
        server.listen("127.0.0.1", -1)
    with pytest.raises(ConfigError, match="not an address of this machine"):
        server.listen("192.0.2.1", 0)  # TEST-NET-1: never assigned to a host
    with pytest.raises(ConfigError, match="empty"):
        server.check_host(" ", allow_remote=True)


def test_ipv6_loopback_address():
    try:
        sock = server.listen("::1", 0)
    except ConfigError:
        pytest.skip("this machine has no IPv6 loopback")
    with sock:
        assert server.bound_url(sock).startswith("http://[::1]:")
        assert sock.family == socket.AF_INET6
