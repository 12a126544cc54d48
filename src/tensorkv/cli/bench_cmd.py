"""``tensorkv bench NAME``: run a workload from :mod:`tensorkv.bench` and print its table."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from collections.abc import Callable

import click

from tensorkv.config import parse_scalar

#: Modules of tensorkv.bench that are machinery, not workloads.
NOT_WORKLOADS = frozenset({"common", "redis_server"})


def workloads() -> list[str]:
    """Names of the available workloads (modules of :mod:`tensorkv.bench`)."""
    import tensorkv.bench as pkg

    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if not m.name.startswith("_") and m.name not in NOT_WORKLOADS and not m.ispkg
    )




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


@click.command(short_help="Run a benchmark workload and its baselines.")
@click.argument("name", metavar="NAME", required=False)
@click.option("--quick", is_flag=True, help="Small sizes: a run takes about a minute.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write the results as JSON to this file.",
)
@click.option(
    "-p",
    "--param",
    "params",
    multiple=True,
    metavar="NAME=VALUE",
    help="Keyword argument for the workload's run(), e.g. -p scale=0.01 (repeatable).",
)
def bench(name: str | None, quick: bool, json_path: str | None, params: tuple[str, ...]) -> None:
    """Run the benchmark workload NAME with its baselines and print the results table.

    The table's first column is the ratio tensorkv / baseline (for throughputs, higher is
    better). Workloads: see the error for an unknown NAME, or docs/benchmarks.md.
    """
    from tensorkv.bench.common import Report

    available = workloads()
    if name is None:
        raise click.UsageError(f"name a workload: tensorkv bench {{{','.join(available)}}}")
    if name not in available:
        raise click.BadParameter(
            f"no benchmark workload {name!r}; available: {', '.join(available) or 'none'}",
            param_hint="NAME",
        )
    try:
        module = importlib.import_module(f"tensorkv.bench.{name}")
    except ImportError as exc:  # an optional dependency of the workload is missing
        raise click.ClickException(f"bench {name} cannot run here: {exc}") from exc
    run_fn = getattr(module, "run", None)
    if run_fn is None:
        raise click.ClickException(f"tensorkv.bench.{name} has no run(quick, report) function")
    kwargs = parse_params(params, run_fn, name)
    click.secho(_header(name, quick), bold=True)
    report = Report(bench=name, quick=quick)
    t0 = time.perf_counter()
    try:
        run_fn(quick, report, **kwargs)
    except (ValueError, ImportError) as exc:
        raise click.ClickException(f"bench {name}: {exc}") from exc
    elapsed = time.perf_counter() - t0
    click.echo("")
    click.echo(report.table())
    click.echo(f"\n{len(report.results)} figures in {elapsed:.1f} s")
    if json_path:
        report.write_json(json_path)
        click.echo(f"wrote {json_path}")
