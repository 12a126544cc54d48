"""The closing lines of ``tensorkv demo``: the resume check and the summary."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import click

from tensorkv.cli.demo_train import RunResult, data_urls
from tensorkv.cli.fmt import human_bytes


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed meanwhile
                total += os.path.getsize(os.path.join(root, name))
    return total


def _tag_line(url: str, tag: str, seconds: float, paused: float | None = None) -> str:
    from tensorkv.checkpoint import list_tags

    info = next((t for t in list_tags(url, details=True) if t.get("tag") == tag), {})
    rows = info.get("table_rows")
    rows_s = f"{sum(rows.values()) if isinstance(rows, dict) else rows:,} rows" if rows else ""
    dense = info.get("dense_bytes")
    dense_s = f" + {human_bytes(dense)} dense" if dense else ""
    if paused is not None:
        return (f"{tag}: {rows_s}{dense_s}, written in {seconds:.2f} s while training went on "
                f"(paused {paused * 1e3:.0f} ms)")
    return f"{tag}: {rows_s}{dense_s}, saved in {seconds:.2f} s"


def print_summary(res: RunResult, path: str, echo: Callable[[str], Any] = click.echo) -> None:
    """Print the resume check and the summary; exit 1 when the resumed losses differ."""
    url, spill, _ = data_urls(path)
    same = res.resumed == res.after_mid
    echo("")
    echo(click.style("resume", bold=True) + f"  {res.mid_tag} loaded into a fresh process, "
         f"steps {res.mid_step + 1}-{res.mid_step + len(res.after_mid)} trained again")
    echo("  this process : " + " ".join(f"{x:.6f}" for x in res.after_mid))
    echo("  fresh process: " + " ".join(f"{x:.6f}" for x in res.resumed))
    verdict = (click.style("identical", fg="green") + f" ({len(res.resumed)}/"
               f"{len(res.after_mid)} losses bit-equal)") if same else click.style(
        "DIFFERENT", fg="red")
    echo(f"  check        : {verdict}")
    s = res.stats
    tiers = s.get("tiers", [])
    echo("")
    echo(click.style("summary", bold=True))
    echo(f"  trained      {res.steps:,} steps, {res.samples:,} samples in {res.seconds:.1f} s "
         f"({res.samples / max(res.seconds, 1e-9):,.0f} samples/s); loss {res.first_loss:.4f} "
         f"-> {res.loss:.4f}, AUC {res.auc:.4f}")
    where = ", ".join(f"{t['rows']:,} in {t['kind']}" for t in tiers)
    echo(f"  rows         {s.get('rows', 0):,} ({where})")
    if tiers:
        t0 = tiers[0]
        looked = t0["hits"] + t0["misses"]
        found = s.get("hits", 0) / max(s.get("hits", 0) + s.get("misses", 0), 1)
        echo(f"  hit ratio    {t0['hits'] / max(looked, 1):.1%} of lookups found their row in "
             f"{t0['kind']}; {found:.1%} "
             "found a row in some tier (the rest were new ids)")
        echo(f"  admission    {s.get('inserts', 0):,} new ids admitted, "
             f"{s.get('admissions_rejected', 0):,} rejected (no admission filter)")
        echo(f"  eviction     {t0['evictions']:,} rows evicted from {t0['kind']} to "
             f"{tiers[-1]['kind']}, {sum(t.get('promotions', 0) for t in tiers):,} promoted back")
    echo(f"  checkpoints  {_tag_line(url, res.mid_tag, res.mid_write_seconds, res.mid_seconds)}")
    echo(f"               {_tag_line(url, res.final_tag, res.final_seconds)} (incremental)")
    echo(f"               store {url} holds {human_bytes(_dir_bytes(url.split('://', 1)[1]))}")
    echo(f"  spill        {spill}: {human_bytes(_dir_bytes(spill))}")
    echo("")
    echo(click.style("next", bold=True))
    echo(f"  tensorkv ls {url}")
    echo(f"  tensorkv view {url}")
    echo(f"  tensorkv check {url}")
    echo("  tensorkv bench train --quick")
    echo("  tensorkv demo tour")
    if not same:
        raise click.ClickException(
            f"the fresh process's losses after {res.mid_tag} differ from this process's; "
            "the checkpoint did not capture the whole training state")
