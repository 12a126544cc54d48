"""Running the web viewer: the address checks, the listening socket and uvicorn.

The viewer binds a loopback address unless told otherwise: :func:`check_host` refuses any
other address without ``allow_remote=True``, and :func:`listen` turns a port in use into an
error that says so and what to do. The socket is bound here (not by uvicorn) so ``port=0``
picks a free port and the caller learns which one before serving starts.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from tensorkv.errors import ConfigError, import_optional

#: The port ``tensorkv view`` listens on unless given ``--port``.
DEFAULT_PORT = 8737

_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback only."""
    name = host.strip("[]").lower()
    if name in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback ``host`` unless ``allow_remote`` is set.

    Raises
    ------
    ConfigError
        ``host`` is empty, or reachable from other machines and ``allow_remote`` is False.
    """
    if not host.strip():
        raise ConfigError("the host to bind is empty; use --host 127.0.0.1")
    if is_loopback(host) or allow_remote:
        return
    raise ConfigError(
        f"refusing to bind {host!r}: the viewer shows every value in the store to whoever can "
        "reach it, and it has no authentication. Bind 127.0.0.1 (the default) and use an SSH "
        "tunnel, or pass --allow-remote to serve other machines on purpose"
    )


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on ``host:port`` (``port=0``: a free port).

    Raises
    ------
    ConfigError
        The port is out of range, in use, or not allowed, or the host is not an address
        of this machine.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is out of range; use 1-65535, or 0 for a free port")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve host {host!r}: {exc.strerror}; use an address such "
                          "as 127.0.0.1") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is in use by another program; choose another with "
                "--port N, or --port 0 for a free one"
            ) from exc
        if exc.errno == errno.EACCES:
            raise ConfigError(f"not allowed to listen on port {port} (ports below 1024 need "
                              "privileges); choose a port above 1024") from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"{host!r} is not an address of this machine; use 127.0.0.1")\
                from exc
        raise
    sock.set_inheritable(True)
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://host:port/`` of a listening socket."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def make_server(app: Any, *, log_level: str = "warning",
                on_ready: Callable[[], None] | None = None) -> Any:
    """A ``uvicorn.Server`` for ``app``; ``on_ready`` runs once it has started.

    Run it with ``server.run(sockets=[sock])``; setting ``server.should_exit`` stops it.
    """
    uvicorn = import_optional("uvicorn", "the web viewer", "view")
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            server_header=False, proxy_headers=False)
    server = uvicorn.Server(config)
    if on_ready is not None:
        startup = server.startup

        async def announced_startup(sockets: Any = None) -> None:
            await startup(sockets=sockets)
            if server.started:
                on_ready()

        server.startup = announced_startup
    return server


def serve(app: Any, sock: socket.socket, *, log_level: str = "warning",
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve ``app`` with uvicorn on the listening ``sock`` until interrupted.

    ``on_ready`` runs once uvicorn has started (the address is printed there).
    """
    server = make_server(app, log_level=log_level, on_ready=on_ready)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
