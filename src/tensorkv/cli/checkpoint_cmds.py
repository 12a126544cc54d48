"""Checkpoint commands of the ``tensorkv`` CLI: tags, check, gc, compact."""

from __future__ import annotations

import json
import time

import click

from tensorkv.errors import TensorKVError


def _fail(exc: Exception) -> None:
    raise click.ClickException(str(exc)) from exc


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


@click.command("tags")
@click.argument("url")
@click.option("--all", "include_expired", is_flag=True, help="Also list expired tags.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def tags_cmd(url: str, include_expired: bool, as_json: bool) -> None:
    """List the checkpoint tags in the store at URL, oldest first."""
    from tensorkv.checkpoint import list_tags

    try:
        rows = list_tags(url, details=True, include_expired=include_expired)
    except TensorKVError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no tags")
        return
    click.echo(f"{'tag':24} {'step':>8} {'created (UTC)':19} {'parent':16} {'MB dense':>9} "
               f"{'rows':>10} expires")
    for r in rows:
        kind = f"{r['parent']}+" if r["incremental"] else "-"
        click.echo(
            f"{r['tag']:24} {str(r['step'] if r['step'] is not None else '-'):>8} "
            f"{_when(r['created']):19} {kind:16} {r['dense_bytes'] / 1e6:9.1f} "
            f"{r['table_rows']:10d} {_when(r['expires'])}"
        )


def _print_report(rep: dict, removed: bool) -> None:
    click.echo(f"tags: {len(rep['tags'])}  expired: {len(rep['expired'])}  "
               f"incomplete sharded saves: {len(rep['incomplete'])}")
    for p in rep["pending"]:
        owner = {"running": "running", "dead": "its process is gone",
                 "unknown": "on another host"}[p["owner"]]
        state = "stale: gc collects it" if p["stale"] else "presumed running"
        click.echo(f"pending save: tag {p['tag']!r} shard {p['shard']} started "
                   f"{p['age']:.0f} s ago by pid {p['pid']} on {p['host']} ({owner}; {state})")
    for r in rep.get("runs", []):
        who = f"run {r['run']!r}" if r["run"] is not None else f"run ~r{r['token']} (no run id)"
        if r["token"] is None:
            who = "shards saved before run ids existed"
        what = {"saving": "saving", "waiting": "waiting for shards (presumed alive)",
                "stale": "stale: gc removes it",
                "complete": "complete but not published"}.get(r["state"], r["state"])
        click.echo(f"sharded save: tag {r['tag']!r} {who}, {r['num_shards']} shards; finished "
                   f"{r['finished']}, missing {r['missing']}; {what}"
                   + (f" ({r['reason']})" if r["reason"] else ""))
    if removed and rep.get("removed_runs"):
        click.echo(f"removed sharded saves: {[r['tag'] for r in rep['removed_runs']]}")
    if removed:
        click.echo(f"removed: {rep['removed_keys']} records ({rep['removed_bytes'] / 1e6:.1f} "
                   f"MB), tags {rep['removed_tags']}")
    else:
        click.echo(f"orphaned records: {rep['orphan_keys']} "
                   f"({rep['orphan_bytes'] / 1e6:.1f} MB)")
    for c in rep["missing"]:
        click.echo(f"MISSING: {c}")
    for c in rep["corrupt"]:
        click.echo(f"CORRUPT: {c}")


@click.command("check")
@click.argument("url")
@click.option("--verify", is_flag=True, help="Read every tag and verify every checksum.")
@click.option("--grace", type=float, default=None,
              help="Seconds a pending save is presumed alive (default 3600).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def check_cmd(url: str, verify: bool, grace: float | None, as_json: bool) -> None:
    """Check the checkpoints at URL: missing records, orphans, pending saves, expired tags.

    With --verify, every tag is read in full and every checksum verified.

    Exits with status 1 when records are missing or corrupt, or orphaned data or stale
    sharded saves (shards of a run that can never publish its tag) are found.
    """
    from tensorkv.checkpoint import check

    try:
        rep = check(url, verify=verify, grace=grace)
    except TensorKVError as exc:
        _fail(exc)
    d = rep.as_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        _print_report(d, removed=False)
        if d["orphan_keys"]:
            click.echo(f"run `tensorkv gc {url}` to remove the orphaned records")
    if not rep.ok:
        raise SystemExit(1)


@click.command("gc")
@click.argument("url")
@click.option("--grace", type=float, default=None,
              help="Leave data of saves started less than this many seconds ago (default 3600).")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
def gc_cmd(url: str, grace: float | None, dry_run: bool) -> None:
    """Remove expired tags and data no tag references from the store at URL."""
    from tensorkv.checkpoint import gc

    try:
        rep = gc(url, grace=grace, dry_run=dry_run)
    except TensorKVError as exc:
        _fail(exc)
    _print_report(rep.as_dict(), removed=not dry_run)


@click.command("compact")
@click.argument("url")
@click.argument("tag")
def compact_cmd(url: str, tag: str) -> None:
    """Fold the incremental chain of TAG into a full tag (its parents are kept)."""
    from tensorkv.checkpoint import compact

    try:
        doc = compact(url, tag)
    except TensorKVError as exc:
        _fail(exc)
    click.echo(f"tag {doc['tag']!r} is a full tag")


@click.command("vacuum")
@click.argument("url")
def vacuum_cmd(url: str) -> None:
    """Give the space of deleted data in the store at URL back to the file system.

    Run it after `tensorkv gc`. LMDB: copies the live pages to a new file and swaps it in
    (refused while another process has the store open); RocksDB, LevelDB: compacts every
    key range. Prints the store's size before and after.
    """
    from tensorkv.stores import open_store

    try:
        with open_store(url, create=False) as store:
            before, after = store.compact()
    except TensorKVError as exc:
        _fail(exc)
    click.echo(f"{url}: {before / 1e6:.1f} MB before, {after / 1e6:.1f} MB after "
               f"({(before - after) / 1e6:.1f} MB given back)")


COMMANDS = [tags_cmd, check_cmd, gc_cmd, compact_cmd, vacuum_cmd]
