"""``tensorkv view``: the read-only web viewer of a store's checkpoints."""

from __future__ import annotations

import contextlib

import click

from tensorkv.errors import TensorKVError


@click.command("view")
@click.argument("url")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Only loopback addresses unless --allow-remote.")
@click.option("--port", type=int, default=None,
              help="Port to listen on (default 8737; 0 picks a free one).")
@click.option("--tag", default=None, help="Tag the pages open on (default: the latest).")
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-loopback --host: anyone who can reach it sees every value "
                   "in the store (the viewer has no authentication).")
def view(url: str, host: str, port: int | None, tag: str | None, allow_remote: bool) -> None:
    """Serve a read-only web viewer of the checkpoints in the store at URL.

    Pages: tags, a tag's variables, a table's rows page by page, key search, predicate
    filters, nearest neighbours, histograms of norm and frequency, a PCA scatter of sampled
    rows, a row's detail, a dense tensor's slice as a heat map, and the diff of two tags.
    Every asset ships in the package (no internet needed); stop with Ctrl-C.

    Exit status: 0 after Ctrl-C; 3 when there is no store at URL or the tag does not exist,
    4 when the store cannot be opened, 2 when the address is refused or the port is in use.
    """
    from tensorkv.viewer.web import server
    from tensorkv.viewer.web.app import LOOPBACK_HOSTS, create_app

    try:
        server.check_host(host, allow_remote)
        sock = server.listen(host, server.DEFAULT_PORT if port is None else port)
    except TensorKVError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        # a loopback viewer answers only requests addressed to a loopback name (no DNS
        # rebinding); one serving other machines on purpose answers any Host
        hosts = [*LOOPBACK_HOSTS, host] if server.is_loopback(host) else ["*"]
        app = create_app(url, tag=tag, allowed_hosts=hosts)
    except TensorKVError as exc:
        sock.close()
        raise click.ClickException(str(exc)) from exc
    except BaseException:
        sock.close()
        raise
    address = server.bound_url(sock)
    shown = app.state.viewer.catalog.url  # as the store shows it (passwords redacted)

    def ready() -> None:
        click.echo(f"tensorkv viewer of {shown} at {address} (read-only; Ctrl-C to stop)")

    with contextlib.suppress(KeyboardInterrupt):  # uvicorn handles SIGINT itself
        server.serve(app, sock, on_ready=ready)
