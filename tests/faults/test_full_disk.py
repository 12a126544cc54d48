"""A full disk under an embedded store: the save fails loudly and leaves everything as it was.

The store lives on a small tmpfs (mounted for the test: root only, skipped otherwise),
nearly filled by another file. A save that does not fit must raise ``StoreFullError`` and
leave no tag; the earlier tag must load bit-identical; once the other file is removed, the
same save succeeds and ``check`` and ``gc`` agree.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorkv
from tensorkv.errors import StoreFullError

from .conftest import EMBEDDED
from .model import SAVE_OPTIONS, assert_loads_as, snapshot, stages

MiB = 1024 * 1024
DISK = 32 * MiB
LEFT = 2 * MiB  # room left on the disk before the big save


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 32 MiB tmpfs mounted under ``tmp_path``, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(path: Path, leave: int) -> None:
    """Write a file that leaves ``leave`` bytes free on its file system."""
    st = os.statvfs(path.parent)
    size = st.f_bavail * st.f_frsize - leave
    with open(path, "wb") as f:
        block = b"\0" * MiB
        while size > 0:
            f.write(block[: min(size, MiB)])
            size -= MiB


def _save_on_full_disk(kind: str, disk: Path) -> tuple[str, dict[str, Any], BaseException]:
    """Save t0, fill the disk, try a save too big for it; ``(url, big model, its error)``."""
    pytest.importorskip({"lmdb": "lmdb", "rocksdb": "rocksdict", "leveldb": "plyvel"}[kind])
    url = f"{kind}://{disk}/store"
    _, model = next(stages())
    tensorkv.save(model, url, "t0", **SAVE_OPTIONS)
    # 8 MiB of incompressible dense data
    big = {**model, "big": np.random.default_rng(1).standard_normal(2 * MiB, dtype=np.float32)}
    _fill(disk / "filler", LEFT)
    try:
        tensorkv.save(big, url, "big", **SAVE_OPTIONS)
    except Exception as exc:  # noqa: BLE001 - what it is, is checked by the callers
        return url, big, exc
    raise AssertionError(f"a save of 8 MiB fitted in the {LEFT} bytes left on the disk")


@pytest.mark.parametrize("kind", EMBEDDED)
def test_a_save_that_does_not_fit_raises_store_full_error(kind, small_disk):
    _, _, exc = _save_on_full_disk(kind, small_disk)
    assert isinstance(exc, StoreFullError), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert "full" in str(exc) and "free space" in str(exc), str(exc)


@pytest.mark.parametrize("kind", EMBEDDED)
def test_earlier_tags_load_while_the_disk_is_full(kind, small_disk):
    url, _, _ = _save_on_full_disk(kind, small_disk)
    if kind == "leveldb":  # LevelDB writes a new log file whenever it opens a store
        with pytest.raises(StoreFullError, match="opening it, which LevelDB does by writing"):
            tensorkv.list_tags(url)
        return
    assert tensorkv.list_tags(url) == ["t0"]
    want = snapshot(next(stages())[1])
    assert_loads_as(tensorkv.load(None, url, "t0"), want, f"{kind}: t0 on a full disk")


@pytest.mark.parametrize("kind", EMBEDDED)
def test_the_save_succeeds_once_there_is_room(kind, small_disk):
    url, big, _ = _save_on_full_disk(kind, small_disk)
    want = {"t0": snapshot(next(stages())[1]), "big": snapshot(big)}
    (small_disk / "filler").unlink()
    assert tensorkv.list_tags(url) == ["t0"]  # the failed save left no tag
    tensorkv.save(big, url, "big", **SAVE_OPTIONS)  # the same save again
    assert tensorkv.list_tags(url) == ["t0", "big"]
    for tag in ("t0", "big"):
        assert_loads_as(tensorkv.load(None, url, tag), want[tag], f"{kind}: {tag}")
    rep = tensorkv.check(url, verify=True)
    assert not rep.corrupt and rep.tags == ["t0", "big"], rep.as_dict()
    tensorkv.gc(url, grace=0)
    rep = tensorkv.check(url, grace=0)
    assert rep.ok and not rep.pending, rep.as_dict()
