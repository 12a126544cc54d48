"""``tensorkv repo``: inspect and maintain a model repository from the shell.

Every command takes the repository's URL (or path); a repository over several providers
takes the others with ``-p URL`` (repeatable), the metadata provider first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tensorkv.cli.fmt import human_bytes
from tensorkv.errors import TensorKVError

if TYPE_CHECKING:
    from tensorkv.repository import Repository


@contextmanager
def _open(url: str, providers: tuple[str, ...], create: bool = False) -> Iterator[Repository]:
    """The repository at ``url``; only ``put`` may create it (a mistyped path is an error)."""
    from tensorkv.repository import Repository

    try:
        repo = Repository([url, *providers], create=create)
    except TensorKVError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        yield repo
    except TensorKVError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        repo.close()


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("-p", "--provider", "providers", multiple=True, metavar="URL",
                      help="Another provider of the repository (repeatable).")(fn)
    return click.argument("url")(fn)


def _json_opt(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(fn)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _metrics(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        try:
            out[k] = float(v)
        except ValueError:
            sep = ""
        if not sep or not k:
            raise click.BadParameter(f"{it!r}: write NAME=NUMBER, e.g. val_acc=0.93")
    return out


@click.group("repo")
def repo() -> None:
    """The model repository: models sharing tensors, prefix queries (see docs/repository.md)."""


@repo.command("ls")
@_common
@click.option("--where", "where", multiple=True, metavar="METRIC>=X",
              help="Keep models whose metric compares so (== != > >= < <=); repeatable.")
@_json_opt
def ls_cmd(url: str, providers: tuple[str, ...], where: tuple[str, ...], as_json: bool) -> None:
    """List the models, oldest first."""
    cond: dict[str, tuple[str, float]] = {}
    for w in where:
        for op in (">=", "<=", "==", "!=", ">", "<"):
            k, sep, v = w.partition(op)
            if sep:
                try:
                    cond[k.strip()] = (op, float(v))
                except ValueError:
                    raise click.BadParameter(f"{w!r}: the value must be a number") from None
                break
        else:
            raise click.BadParameter(f"{w!r}: write METRIC OP NUMBER, e.g. val_acc>=0.9")
    with _open(url, providers) as r:
        rows = r.list(cond or None)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no models")
        return
    click.echo(f"{'id':20} {'name':16} {'created (UTC)':19} {'layers':>6} {'tensors':>7} "
               f"{'size':>9}  metrics")
    for x in rows:
        mets = " ".join(f"{k}={v:g}" for k, v in x["metrics"].items())
        click.echo(f"{x['id']:20} {str(x['name'] or '-'):16} {_when(x['created']):19} "
                   f"{x['layers']:6d} {x['tensors']:7d} {human_bytes(x['nbytes']):>9}  {mets}")


@repo.command("show")
@_common
@click.argument("model_id")
@_json_opt
def show_cmd(url: str, providers: tuple[str, ...], model_id: str, as_json: bool) -> None:
    """Show a model: metadata, its graph's layers (by module path) and its tensors."""
    with _open(url, providers) as r:
        m = r.manifest(model_id)
    if as_json:
        click.echo(json.dumps(m, indent=2))
        return
    click.echo(f"model {m['id']}  name={m['name'] or '-'}  parent={m['parent'] or '-'}  "
               f"created {_when(m['created'])}")
    click.echo(f"metrics: {json.dumps(m['metrics'])}")
    nodes = m["graph"]["nodes"]
    click.echo(f"graph: {len(nodes)} nodes")
    hashes = m.get("hashes") or [""] * len(nodes)
    click.echo(f"{'layer':40} {'type':30} hash")
    for node, h in zip(nodes, hashes, strict=False):
        click.echo(f"{node['name']:40} {node.get('type', ''):30} {h[:12]}")
    click.echo(f"{'tensor':40} {'dtype':9} {'shape':20} {'size':>9}  id")
    for name, e in m["tensors"].items():
        click.echo(f"{name:40} {e['dtype']:9} {str(tuple(e['shape'])):20} "
                   f"{human_bytes(e['nbytes']):>9}  {e['id'][:12]}")


@repo.command("stats")
@_common
@_json_opt
def stats_cmd(url: str, providers: tuple[str, ...], as_json: bool) -> None:
    """Models, tensors, bytes stored and referenced, per provider."""
    with _open(url, providers) as r:
        s = r.stats()
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    click.echo(f"models: {s['models']}  tensors: {s['tensors']}  stored: "
               f"{human_bytes(s['bytes_stored'])}  referenced: "
               f"{human_bytes(s['bytes_referenced'])}")
    for p in s["providers"]:
        click.echo(f"  {p['url']}: {p['chunks']} chunks, {human_bytes(p['bytes'])}")


@repo.command("gc")
@_common
@click.option("--grace", type=float, default=3600.0, show_default=True,
              help="Seconds a put or delete in flight is presumed running.")
@_json_opt
def gc_cmd(url: str, providers: tuple[str, ...], grace: float, as_json: bool) -> None:
    """Reclaim what killed writers left; fix reference counts."""
    with _open(url, providers) as r:
        rep = r.gc(grace)
    click.echo(json.dumps(rep, indent=2) if as_json else
               "  ".join(f"{k}: {v}" for k, v in rep.items()))


@repo.command("check")
@_common
@click.option("--verify", is_flag=True, help="Also read every chunk and verify its checksum.")
@click.option("--deep", is_flag=True, hidden=True, help="The old name of --verify.")
@_json_opt
def check_cmd(url: str, providers: tuple[str, ...], verify: bool, deep: bool,
              as_json: bool) -> None:
    """Verify manifests, chunks and reference counts (exit status 1 on a problem)."""
    if deep:
        click.echo("--deep is deprecated and will be removed in the next release; use --verify",
                   err=True)
    with _open(url, providers) as r:
        rep = r.check(verify=verify or deep)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        click.echo(f"models: {rep['models']}  tensors: {rep['tensors']}  "
                   f"problems: {len(rep['problems'])}")
        for p in rep["problems"]:
            click.echo(f"  {p}")
    if not rep["ok"]:
        raise click.exceptions.Exit(1)


@repo.command("rm")
@_common
@click.argument("model_ids", nargs=-1, required=True)
def rm_cmd(url: str, providers: tuple[str, ...], model_ids: tuple[str, ...]) -> None:
    """Delete models; tensors no other model uses are retired."""
    with _open(url, providers) as r:
        for mid in model_ids:
            n = r.delete(mid)
            click.echo(f"deleted {mid} ({n} tensors retired)")


@repo.command("get")
@_common
@click.argument("model_id")
@click.argument("out", type=click.Path(dir_okay=False))
def get_cmd(url: str, providers: tuple[str, ...], model_id: str, out: str) -> None:
    """Write a model's state dict to OUT (.npz: numpy arrays; else torch.save)."""
    with _open(url, providers) as r:
        if out.endswith(".npz"):
            import numpy as np

            np.savez(out, **r.get(model_id, as_numpy=True))
        else:
            import torch

            torch.save(r.get(model_id), out)
    click.echo(f"wrote {out}")


def _load_state(path: str) -> dict[str, Any]:
    if path.endswith(".npz"):
        import numpy as np

        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    import torch

    return dict(torch.load(path, weights_only=True))


@repo.command("put")
@_common
@click.argument("graph", type=click.Path(exists=True, dir_okay=False))
@click.argument("state", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", help="A label for the model.")
@click.option("--metric", "metric", multiple=True, metavar="NAME=X", help="Repeatable.")
@click.option("--parent", help="Id of the model this one derives from.")
def put_cmd(url: str, providers: tuple[str, ...], graph: str, state: str, name: str | None,
            metric: tuple[str, ...], parent: str | None) -> None:
    """Store a model from a graph JSON file and a state dict (.npz or torch.save file)."""
    g = json.loads(Path(graph).read_text())
    with _open(url, providers, create=True) as r:
        mid = r.put(g, _load_state(state), name=name, metrics=_metrics(metric), parent=parent)
    click.echo(mid)


@repo.command("prefix")
@_common
@click.argument("graph", type=click.Path(exists=True, dir_okay=False))
@click.option("--metric", default="val_acc", show_default=True, help="Breaks ties.")
@_json_opt
def prefix_cmd(url: str, providers: tuple[str, ...], graph: str, metric: str,
               as_json: bool) -> None:
    """The stored model sharing the longest prefix with the graph in a JSON file."""
    g = json.loads(Path(graph).read_text())
    with _open(url, providers) as r:
        mid, layers = r.longest_prefix(g, metric)
    if as_json:
        click.echo(json.dumps({"id": mid, "matched_layers": layers}))
    elif mid is None:
        click.echo("no stored model shares a layer")
    else:
        click.echo(f"{mid}: {len(layers)} of {len(g['nodes'])} layers match")


@repo.command("rebalance")
@_common
def rebalance_cmd(url: str, providers: tuple[str, ...]) -> None:
    """Move tensors to their home provider after adding one (run with no writer active)."""
    with _open(url, providers) as r:
        rep = r.rebalance()
    click.echo(f"moved {rep['moved_tensors']} tensors ({human_bytes(rep['moved_bytes'])})")


COMMANDS = [repo]
