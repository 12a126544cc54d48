"""check finds missing records without --verify; load into a dict is strict; gc sizes."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import layout, manifest, refs
from tensorkv.errors import CheckpointError

from .helpers import make_table


def _model():
    return {"w": np.arange(5000, dtype=np.float32), "emb": make_table(2000, 8)}


@pytest.mark.parametrize("kind", ["chunk", "block", "keys"])
def test_check_finds_a_deleted_record_without_verify(url, kind):
    tensorkv.save(_model(), url, "a", block_rows=256)
    tensorkv.save(_model(), url, "b", block_rows=256)  # shares a's dense chunks
    with tensorkv.open_store(url) as s:
        keys = refs.record_keys(manifest.read(s, "a"))
        victim = {
            "chunk": [k for k in keys if k.startswith(layout.CHUNK)][0],
            "block": [k for k in keys if b"/b/" in k][-1],
            "keys": [k for k in keys if b"/k/" in k][0],
        }[kind]
        s.delete(victim)
    rep = tensorkv.checkpoint.check(url)
    assert not rep.ok and not rep.orphan_keys
    want = ["a", "b"] if kind == "chunk" else ["a"]
    assert sorted(m.split(":")[0] for m in rep.missing) == want, rep.missing
    assert repr(victim) in rep.missing[0]


def test_check_cli_reports_missing_and_exits_1(url, tmp_path):
    from click.testing import CliRunner

    from tensorkv.cli.main import main as cli

    tensorkv.save(_model(), url, "a", block_rows=256)
    with tensorkv.open_store(url) as s:
        s.delete([k for k in refs.record_keys(manifest.read(s, "a")) if b"/b/" in k][0])
    r = CliRunner().invoke(cli, ["check", url])
    assert r.exit_code == 1 and "MISSING: a: 1 of" in r.output, r.output


def test_load_into_a_dict_refuses_names_the_tag_lacks(mem_url):
    tensorkv.save({"w": np.ones(3, np.float32)}, mem_url, "a")
    target = {"w": np.zeros(3, np.float32), "extra": np.zeros(2, np.float32)}
    with pytest.raises(CheckpointError, match=r"has \['extra'\].*holds \['w'\].*partial=True"):
        tensorkv.load(target, mem_url, "a")
    assert target["w"].tolist() == [0, 0, 0]  # nothing was touched
    tensorkv.load(target, mem_url, "a", partial=True)
    assert target["w"].tolist() == [1, 1, 1] and target["extra"].tolist() == [0, 0]
    tensorkv.load(target, mem_url, "a", variables=["w"])  # choosing names is explicit too


def test_gc_reports_the_bytes_it_removes(mem_url):
    tensorkv.save(_model(), mem_url, "a", block_rows=256)
    with tensorkv.open_store(mem_url) as s:
        s.put(layout.TABLE + b"ghost/emb/0/b/00/00000000", b"x" * 1000)
        s.put(layout.chunk_key("0" * 32), b"y" * 500)
    rep = tensorkv.checkpoint.check(mem_url)
    assert len(rep.orphan_keys) == 2 and rep.orphan_bytes == 1500
    rep = tensorkv.checkpoint.gc(mem_url)
    assert rep.removed_keys == 2 and rep.removed_bytes == 1500
    assert tensorkv.checkpoint.check(mem_url).ok


def test_gc_counts_the_records_of_the_expired_tags_it_removes(url, monkeypatch):
    import time

    from click.testing import CliRunner

    from tensorkv.cli.main import main as cli

    tensorkv.save(_model(), url, "keep", block_rows=256)
    old = {"w": np.arange(7, dtype=np.float32), "emb": make_table(1000, 8, seed=5)}
    tensorkv.save(old, url, "old", block_rows=256, ttl=60)
    with tensorkv.open_store(url) as s:
        shared = set(refs.record_keys(manifest.read(s, "keep")))
        doc = manifest.read(s, "old")
        owned = [layout.manifest_key("old")] + [k for k in refs.record_keys(doc)
                                                if k not in shared]
        sizes = s.value_sizes(owned)
    assert (sizes > 0).all() and len(owned) > 10
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # "old" has expired
    r = CliRunner().invoke(cli, ["gc", url])
    assert r.exit_code == 0, r.output
    want = f"removed: {len(owned)} records ({int(sizes.sum()) / 1e6:.1f} MB), tags ['old']"
    assert want in r.output, r.output
    with tensorkv.open_store(url) as s:
        assert (s.value_sizes(owned) < 0).all()
    assert tensorkv.checkpoint.check(url).ok
