"""``tensorkv bench NAME``: run a workload from :mod:`tensorkv.bench` and print its table.

``tensorkv bench --help`` lists the workloads, one line each (the first line of each module's
docstring, read without importing it); ``tensorkv bench NAME --help`` shows the workload's
description and every ``-p NAME=VALUE`` parameter with its default.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import time
from collections.abc import Callable
from types import ModuleType

import click

from tensorkv.config import parse_scalar
from tensorkv.errors import BenchmarkError

#: Modules of tensorkv.bench that are machinery, not workloads.
NOT_WORKLOADS = frozenset({"common", "dlrm", "redis_server", "train_features"})
#: run() arguments that are not ``-p`` parameters.
_POSITIONAL = ("quick", "report")


def workloads() -> list[str]:
    """Names of the available workloads (modules of :mod:`tensorkv.bench`, ``_`` -> ``-``)."""
    import tensorkv.bench as pkg

    return sorted(
        m.name.replace("_", "-")
        for m in pkgutil.iter_modules(pkg.__path__)
        if not m.name.startswith("_") and m.name not in NOT_WORKLOADS and not m.ispkg
    )


def _module_doc(name: str) -> str:
    """The docstring of ``tensorkv.bench.NAME``, read from its source (nothing is imported)."""
    spec = importlib.util.find_spec(f"tensorkv.bench.{name.replace('-', '_')}")
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _plain(text: str) -> str:
    """Turn reST inline literals as plain backquotes, for the terminal."""
    return text.replace("``", "`")


def summary(name: str) -> str:
    """One line on what workload ``name`` measures (its docstring's first line)."""
    first = _module_doc(name).strip().split("\n", 1)[0]
    return _plain(re.sub(r"^``tensorkv bench [\w-]+``:\s*", "", first))


def param_docs(run_fn: Callable[..., object]) -> dict[str, str]:
    """Descriptions of ``run_fn``'s parameters from the NumPy "Parameters" section."""
    doc = inspect.getdoc(run_fn) or ""
    m = re.search(r"^Parameters\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", doc, flags=re.S | re.M)
    out: dict[str, str] = {}
    current = ""
    for line in (m.group(1) if m else "").splitlines():
        if line and not line[0].isspace():
            current = line.split(":", 1)[0].strip()
            out[current] = ""
        elif current and line.strip():
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


def run_notes(run_fn: Callable[..., object]) -> str:
    """The prose of ``run_fn``'s docstring after its first line, without "Parameters"."""
    doc = inspect.getdoc(run_fn) or ""
    body = doc.split("\n", 1)[1] if "\n" in doc else ""
    body = re.split(r"^Parameters\n-+\n", body, flags=re.M)[0]
    return _plain(body.strip())


def parameters(run_fn: Callable[..., object]) -> list[tuple[str, str]]:
    """``(NAME=DEFAULT, description)`` for every ``-p`` parameter of ``run_fn``."""
    docs = param_docs(run_fn)
    rows = []
    for p in inspect.signature(run_fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = p.default
        if default is None:
            shown = "(auto)"
        elif isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, tuple | list):
            shown = ",".join(str(v) for v in default)
        else:
            shown = str(default)
        rows.append((f"{p.name}={shown}", _plain(docs.get(p.name, ""))))
    return rows


def parse_params(
    pairs: tuple[str, ...], run_fn: Callable[..., object], name: str
) -> dict[str, object]:
    """Turn ``NAME=VALUE`` strings into keyword arguments accepted by ``run_fn``."""
    sig = inspect.signature(run_fn)
    accepted = [
        p.name
        for p in sig.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise click.BadParameter(
                f"{pair!r} is not NAME=VALUE; write e.g. --param scale=0.01", param_hint="--param"
            )
        if key not in accepted:
            hint = ", ".join(accepted) if accepted else "none"
            raise click.BadParameter(
                f"workload {name!r} takes no parameter {key!r}; it takes: {hint}",
                param_hint="--param",
            )
        out[key] = parse_scalar(value)
    return out


def _header(name: str, quick: bool) -> str:
    from tensorkv import __version__
    from tensorkv.bench.common import machine_info

    m = machine_info()
    parts = [
        f"tensorkv {__version__}",
        f"python {m.get('python', '?')}",
        f"numpy {m.get('numpy', '?')}",
        m.get("cpu_model") or m.get("processor") or "?",
        f"{m.get('cpus', '?')} CPUs",
    ]
    if "memory_gib" in m:
        parts.append(f"{m['memory_gib']} GiB RAM")
    mode = "quick" if quick else "full"
    return f"tensorkv bench {name} ({mode})\n  " + " | ".join(str(p) for p in parts)


def _load(name: str) -> tuple[ModuleType, Callable[..., object]]:
    """Import workload ``name``; a clear error where a dependency is missing."""
    try:
        module = importlib.import_module(f"tensorkv.bench.{name.replace('-', '_')}")
    except ImportError as exc:  # an optional dependency of the workload is missing
        raise click.ClickException(f"bench {name} cannot run here: {exc}") from exc
    run_fn = getattr(module, "run", None)
    if run_fn is None:
        raise click.ClickException(f"tensorkv.bench.{name} has no run(quick, report) function")
    return module, run_fn


def _run(
    name: str, quick: bool, json_path: str | None, params: tuple[str, ...], dry_run: bool
) -> None:
    from tensorkv.bench.common import Report

    _, run_fn = _load(name)
    kwargs = parse_params(params, run_fn, name)
    if dry_run:
        args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        click.echo(f"would run tensorkv.bench.{name}.run(quick={quick}{args})")
        return
    click.secho(_header(name, quick), bold=True)
    report = Report(bench=name, quick=quick)
    t0 = time.perf_counter()
    try:
        run_fn(quick, report, **kwargs)
    except (ValueError, ImportError, BenchmarkError) as exc:
        raise click.ClickException(f"bench {name}: {exc}") from exc
    elapsed = time.perf_counter() - t0
    click.echo("")
    click.echo(report.table())
    click.echo(f"\n{len(report.results)} figures in {elapsed:.1f} s")
    if json_path:
        report.write_json(json_path)
        click.echo(f"wrote {json_path}")


class WorkloadCommand(click.Command):
    """``tensorkv bench NAME``: one workload, its description and its ``-p`` parameters."""

    def __init__(self, name: str) -> None:
        doc = _module_doc(name)
        paragraphs = [_plain(p) for p in doc.split("\n\n")[1:]]
        # click rewraps paragraphs; "\b" keeps bullet lists as written
        body = "\n\n".join(("\b\n" + p) if p.lstrip().startswith("* ") else p
                           for p in paragraphs)
        super().__init__(
            name,
            callback=lambda **kw: _run(name, **kw),
            help=f"{summary(name)}\n\n{body}".strip(),
            short_help=summary(name),
            params=[
                click.Option(["--quick"], is_flag=True,
                             help="Small sizes: a run takes about a minute."),
                click.Option(["--json", "json_path"],
                             type=click.Path(dir_okay=False, writable=True),
                             help="Also write the results as JSON to this file."),
                click.Option(["-p", "--param", "params"], multiple=True, metavar="NAME=VALUE",
                             help="Set a parameter of the workload (below); repeatable."),
                click.Option(["--dry-run"], is_flag=True,
                             help="Check NAME and the parameters, print the call, run nothing."),
            ],
        )

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Options, then the workload's ``-p`` parameters with their defaults."""
        super().format_options(ctx, formatter)
        try:
            _, run_fn = _load(str(self.name))
        except click.ClickException as exc:
            rows, notes = [("(unavailable)", exc.format_message())], ""
        else:
            rows, notes = parameters(run_fn), run_notes(run_fn)
        with formatter.section("Parameters (-p NAME=VALUE; true/false, numbers, a,b,c lists)"):
            formatter.write_dl(rows)
            if notes:
                formatter.write_paragraph()
                formatter.write_text(notes)


class BenchGroup(click.Group):
    """The workloads as subcommands, found in :mod:`tensorkv.bench` when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every workload name."""
        return workloads()

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command of workload ``cmd_name`` (None if there is none)."""
        return WorkloadCommand(cmd_name) if cmd_name in workloads() else None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """Refuse an unknown workload name, listing the available ones."""
        if args and not args[0].startswith("-") and args[0] not in workloads():
            raise click.BadParameter(
                f"no benchmark workload {args[0]!r}; available: "
                f"{', '.join(workloads()) or 'none'}",
                param_hint="NAME",
            )
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List the workloads, one line each."""
        rows = [(name, summary(name)) for name in workloads()]
        with formatter.section("Workloads (tensorkv bench NAME --help for each one's parameters)"):
            formatter.write_dl(rows)


@click.group(cls=BenchGroup, short_help="Run a benchmark workload and its baselines.",
             subcommand_metavar="NAME [--quick] [--json FILE] [-p NAME=VALUE ...]")
def bench() -> None:
    """Run the benchmark workload NAME with its baselines and print the results table.

    The table's first column is the ratio tensorkv / baseline (for throughputs, higher is
    better). Each workload runs its baselines in the same process on the same data.
    Figures and how they were measured: docs/benchmarks.md.
    """
