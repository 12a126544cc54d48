"""Entry point of the ``tensorkv`` command (``tensorkv --help`` lists the subcommands)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

import click

from tensorkv import __version__
from tensorkv.cli.bench_cmd import bench
from tensorkv.cli.demo import demo
from tensorkv.cli.exits import BACKEND_MODULES, EPILOG, exit_code_of
from tensorkv.cli.ps_cmd import ps
from tensorkv.cli.repo_cmds import repo as repo_group
from tensorkv.cli.view_cmd import view
from tensorkv.errors import MissingDependencyError, TensorKVError
from tensorkv.stores import Capabilities, schemes
from tensorkv.stores.registry import backend_class

_FLAGS = (
    ("ordered_scans", "ordered"),
    ("atomic_batches", "atomic"),
    ("durable_on_return", "durable"),
    ("multi_process", "shared"),
    ("distributed", "distributed"),
)


#: Set to 1 to see the full traceback of an error instead of a one-line message.
DEBUG_ENV = "TENSORKV_DEBUG"


def error_message(exc: BaseException) -> str:
    """The one line ``tensorkv: error: ...`` that stands for ``exc``."""
    if isinstance(exc, click.ClickException) and isinstance(exc.__cause__, TensorKVError):
        exc = exc.__cause__  # a command's _fail(): the message of what it caught
    raw = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, click.ClickException):
        raw = exc.format_message()
    text = " ".join(raw.split()) or type(exc).__name__
    if isinstance(exc, (TensorKVError, click.ClickException)):
        return f"tensorkv: error: {text}"
    origin = type(exc).__module__.split(".")[0]
    if origin in BACKEND_MODULES or isinstance(exc, (OSError, MemoryError)):
        return f"tensorkv: error: {type(exc).__name__}: {text}"
    return (
        f"tensorkv: error: unexpected {type(exc).__name__}: {text} (run again with "
        f"{DEBUG_ENV}=1 for the traceback and report it)"
    )


class _Group(click.Group):
    """The command group; an error of a subcommand is one line on stderr, not a traceback.

    The exit status of every error is :func:`tensorkv.cli.exits.exit_code_of`'s.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.UsageError, click.Abort):
            raise
        except click.ClickException as exc:  # a command's own refusal: the same one line
            if _debug() and isinstance(exc.__cause__, Exception):
                raise exc.__cause__ from None
            click.echo(error_message(exc), err=True)
            ctx.exit(exit_code_of(exc))
        except Exception as exc:
            if _debug():
                raise
            click.echo(error_message(exc), err=True)
            ctx.exit(exit_code_of(exc))


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EPILOG,
)
@click.version_option(__version__, "-V", "--version", prog_name="tensorkv")
def main() -> None:
    """tensorkv: deep-learning parameters in key-value storage.

    Dynamic embedding tables and checkpoints in LMDB, RocksDB, LevelDB or Redis.
    Start with `tensorkv demo`.
    """


def scheme_capabilities(scheme: str) -> Capabilities:
    """The capability flags of the backend serving ``scheme`` (imports the backend).

    A backend whose guarantees depend on the scheme (Redis Cluster is distributed and
    without cross-slot transactions) may expose ``capabilities_for(scheme)``.
    """
    cls = backend_class(scheme)
    per_scheme = getattr(cls, "capabilities_for", None)
    if per_scheme is not None:
        return per_scheme(scheme)
    if "+cluster" in scheme:  # RedisStore sets cluster flags per instance
        module = sys.modules[cls.__module__]
        caps = getattr(module, "CLUSTER_CAPABILITIES", None) or getattr(
            module, "_CLUSTER_CAPS", None
        )
        if caps is not None:
            return caps
    return cls.capabilities


def backend_rows() -> list[dict[str, object]]:
    """One row per registered URL scheme: class, dependency status and capability flags."""
    rows: list[dict[str, object]] = []
    for scheme in schemes():
        row: dict[str, object] = {"scheme": scheme, "backend": "", "status": "ok"}
        try:
            cls = backend_class(scheme)
        except MissingDependencyError as exc:
            m = re.search(r"tensorkv\[[\w,]+\]", str(exc))
            row["status"] = f'missing: pip install "{m.group(0)}"' if m else f"missing: {exc}"
        except ImportError as exc:
            row["status"] = f"unavailable: {exc}"
        else:
            row["backend"] = cls.__name__
            row.update(scheme_capabilities(scheme).as_dict())
        rows.append(row)
    return rows


@click.command(short_help="List store URL schemes and their guarantees.")
def stores() -> None:
    """List the store URL schemes, whether each backend can load, and what it guarantees.

    Columns: ordered = scans in key order, atomic = batches all-or-nothing, durable = on disk
    when a write returns, shared = several processes at once, distributed = spans machines.
    """
    rows = backend_rows()
    head = ["scheme", "backend", *[short for _, short in _FLAGS], "dependency"]
    table = []
    for r in rows:
        flags = [
            ("-" if f not in r else ("yes" if r[f] else "no")) for f, _ in _FLAGS
        ]
        table.append([f"{r['scheme']}://", str(r["backend"]) or "-", *flags, str(r["status"])])
    widths = [max(len(head[i]), *(len(t[i]) for t in table)) for i in range(len(head))]
    click.secho("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), bold=True)
    for t in table:
        cells = []
        for i, (c, w) in enumerate(zip(t, widths, strict=True)):
            text = c.ljust(w)
            if i == len(t) - 1:
                text = click.style(c, fg="green" if c == "ok" else "yellow")
            elif c == "yes":
                text = click.style(text, fg="green")
            cells.append(text)
        click.echo("  ".join(cells).rstrip())


main.add_command(demo)
main.add_command(bench)
main.add_command(stores)
main.add_command(view)
main.add_command(ps)
main.add_command(repo_group)

try:  # checkpoint tools live in their own module, added when it exists
    checkpoint_cmds = importlib.import_module("tensorkv.cli.checkpoint_cmds")
except ImportError as exc:  # tolerate only the module's absence, not a broken import
    if exc.name != "tensorkv.cli.checkpoint_cmds":
        raise
else:
    for _cmd in checkpoint_cmds.COMMANDS:
        main.add_command(_cmd)

# the viewer's commands (ls, show, search, stats, diff, export): cli/viewer_cmds.py
for _cmd in importlib.import_module("tensorkv.cli.viewer_cmds").COMMANDS:
    main.add_command(_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
