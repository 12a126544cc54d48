"""Shared machinery for ``tensorkv bench``: timing, results, the printed table and JSON.

A workload module ``tensorkv.bench.NAME`` defines ``run(quick: bool, report: Report) -> None``
that measures tensorkv and its baselines in the same process and calls
:meth:`Report.add` for each figure. ``ratio`` is always ``value / baseline_value``; the metric
name says which direction is better (``MB/s`` higher, ``bytes/key`` lower).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tensorkv.errors import BenchmarkError

#: The kernel file whose write drops the page cache of the whole machine (root only).
DROP_CACHES_FILE = "/proc/sys/vm/drop_caches"


@dataclass
class Result:
    """One measured figure and its baseline from the same run."""

    case: str
    metric: str
    value: float
    baseline: str
    baseline_value: float
    ratio: float
    note: str = ""


@dataclass
class Timing:
    """Wall-clock seconds of repeated runs of one operation."""

    samples: list[float]

    @property
    def median(self) -> float:
        """Median seconds."""
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        """Fastest run in seconds."""
        return min(self.samples)

    def quantile(self, q: float) -> float:
        """Seconds at quantile ``q`` (0..1)."""
        return float(np.quantile(np.asarray(self.samples), q))


def measure(
    fn: Callable[[], Any],
    *,
    repeat: int = 5,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``fn`` ``repeat`` times after ``warmup`` untimed runs.

    Parameters
    ----------
    fn
        The operation; its return value is ignored.
    repeat
        Timed runs.
    warmup
        Untimed runs first (JIT compilation, page faults, caches).
    setup
        Called untimed before every run (warm-up runs included).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing(samples)


def machine_info() -> dict[str, Any]:
    """Describe the machine the figures come from."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / 1024**2, 1)
                    break
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:  # pragma: no cover - numba is a core dependency
        pass
    return info


@dataclass
class Report:
    """Results of one benchmark run."""

    bench: str
    quick: bool = False
    results: list[Result] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    echo: bool = True

    def add(
        self,
        case: str,
        metric: str,
        value: float,
        baseline: str,
        baseline_value: float,
        note: str = "",
    ) -> Result:
        """Record one figure; ``ratio`` is ``value / baseline_value``."""
        ratio = float(value) / float(baseline_value) if baseline_value else float("nan")
        r = Result(case, metric, float(value), baseline, float(baseline_value), ratio, note)
        self.results.append(r)
        if self.echo:
            print(
                f"  {case:<44} {metric:<10} {_fmt(value):>10}  vs {baseline:<28} "
                f"{_fmt(baseline_value):>10}  ratio {ratio:6.2f}",
                flush=True,
            )
        return r

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: ``{"bench", "machine", "results": [...]}``."""
        return {
            "bench": self.bench,
            "quick": self.quick,
            "params": self.params,
            "machine": machine_info(),
            "results": [asdict(r) for r in self.results],
        }

    def write_json(self, path: str) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def table(self) -> str:
        """The results as a Markdown table with the ratio first."""
        lines = [
            "| ratio | case | metric | tensorkv | baseline | baseline value | note |",
            "|---:|---|---|---:|---|---:|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {r.ratio:.2f} | {r.case} | {r.metric} | {_fmt(r.value)} | {r.baseline} | "
                f"{_fmt(r.baseline_value)} | {r.note} |"
            )
        return "\n".join(lines)


def drop_page_cache(report: Report) -> None:
    """Write back dirty pages and drop the whole machine's page cache (root only).

    This reaches beyond the benchmark's own files (every process loses its cached file
    pages), so a workload calls it only when asked to (``-p drop_caches=true``). Each call is
    counted in ``report.params["page_cache_drops"]``, which the JSON output carries.

    Raises
    ------
    BenchmarkError
        Where the kernel refuses the write (not root, or a container without access).
    """
    report.params["page_cache_drops"] = report.params.get("page_cache_drops", 0) + 1
    why = "" if os.access(DROP_CACHES_FILE, os.W_OK) else "permission denied"
    if not why:
        os.sync()
        try:
            with open(DROP_CACHES_FILE, "w") as f:
                f.write("3\n")
        except OSError as exc:
            why = str(exc)
    if why:
        raise BenchmarkError(
            f"drop_caches=true needs write access to {DROP_CACHES_FILE} ({why}); run as "
            "root, or leave drop_caches false (reads may then come from the page cache)"
        )


def _fmt(x: float) -> str:
    if x != x:  # NaN
        return "nan"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"
