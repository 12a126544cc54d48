"""``tensorkv ps``: look at a running parameter server (:mod:`tensorkv.distributed`)."""

from __future__ import annotations

import json
from typing import Any

import click


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def status_lines(shards: list[dict[str, Any]]) -> list[str]:
    """The status table: one line per shard and table."""
    lines = [f"{'shard':>5} {'pid':>8} {'table':<16} {'rows':>12} {'bytes':>11} "
             f"{'tiers (rows)':<20} {'requests':>9} {'req/s':>8}  checkpoint"]
    for s in shards:
        tables = s["tables"] or {"-": {"rows": 0, "bytes": 0, "tiers": []}}
        for name, t in tables.items():
            tiers = "/".join(str(x.get("rows", "?")) for x in t["tiers"]) or "DRAM"
            lines.append(
                f"{s['index']:>5} {s['pid']:>8} {name:<16} {t['rows']:>12,} "
                f"{_fmt_bytes(t['bytes']):>11} {tiers:<20} {s['requests']:>9,} "
                f"{s['requests_per_s']:>8.1f}  {s['checkpoint'] or '-'}")
    return lines


@click.group()
def ps() -> None:
    """Parameter servers on Ray (docs/distributed.md)."""


@ps.command()
@click.argument("name")
@click.option("--address", default="auto", show_default=True,
              help="Ray cluster to connect to (as for ray.init).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(name: str, address: str, as_json: bool) -> None:
    """Shards, rows, bytes, tiers and requests/s of the parameter server NAME."""
    from tensorkv.distributed import ParameterServer
    from tensorkv.distributed.channel import ray_module
    from tensorkv.distributed.server import NAMESPACE

    ray = ray_module()
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)
        except ConnectionError as exc:
            raise click.ClickException(
                f"no Ray cluster at address={address!r} ({exc}); start one (ray start --head) "
                "or pass --address") from None
    shards = ParameterServer(name=name).status()
    if as_json:
        click.echo(json.dumps(shards, indent=2, default=str))
        return
    for line in status_lines(shards):
        click.echo(line)
