"""Conformance tests every KVStore backend passes.

Subclass :class:`StoreTests` in a backend's test module and provide a ``store_url`` fixture
(a URL that opens a fresh, empty store; called once per test) — the suite opens the store
with :func:`tensorkv.open_store` and closes it afterwards::

    class TestMyStore(StoreTests):
        persistent = True

        @pytest.fixture
        def store_url(self, tmp_path):
            return f"lmdb://{tmp_path}/db"

Class attributes tune the suite: ``persistent`` (data survives close and reopen),
``supports_subprocess`` (the URL can be opened by another process), ``large_value_bytes``
and ``open_options`` (keyword options passed to every ``open_store`` call, in this process
and in child processes, e.g. ``{"sync": False}`` to run the suite on a second configuration).

The suite checks each :class:`~tensorkv.stores.Capabilities` claim the store makes: ordered
scans, atomic batches (a child process is SIGKILLed inside the backend's commit of a large
batch, see :func:`tensorkv.testing.kill.kill_inside_next_write`),
process-crash survival of a write that returned, and sharing between processes.
:func:`unwritable_directory` helps backends test their permission errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

from tensorkv.config import STORE_SCAN_CHUNK
from tensorkv.errors import (
    EmptyKeyError,
    KeyNotFoundError,
    KeyTypeError,
    ReadOnlyError,
    StoreClosedError,
    ValueTooLargeError,
)
from tensorkv.stores import KVStore, open_store


def unwritable_directory(tmp_path: str | os.PathLike[str]) -> str:
    """Return a directory this process cannot create entries in (for permission tests).

    As a regular user that is a ``chmod 0o500`` directory under ``tmp_path``. Root ignores
    permission bits, so there the read-only ``/sys`` is used when the kernel refuses a
    directory in it; otherwise the calling test is skipped with the reason.
    """
    if os.geteuid() != 0:
        path = os.path.join(str(tmp_path), "read-only-dir")
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o500)
        return path
    probe = "/sys/tensorkv-permission-probe"
    try:
        os.mkdir(probe)
    except PermissionError:
        return "/sys"
    except OSError as exc:
        pytest.skip(f"running as root (chmod does not stop root) and /sys is unusable: {exc}")
    os.rmdir(probe)
    pytest.skip("running as root: chmod does not stop root and /sys accepts new directories")


def _as_bytes(values: list[bytes | None]) -> list[bytes | None]:
    """Return ``values`` as ``bytes`` (a backend may return another bytes-like type)."""
    return [None if v is None else bytes(v) for v in values]


class StoreTests:
    """The KVStore contract, as pytest tests. Subclasses provide a ``store_url`` fixture."""

    persistent: bool = True
    supports_subprocess: bool = True
    large_value_bytes: int = 4 * 1024 * 1024
    open_options: dict[str, Any] = {}

    # ----------------------------------------------------------------- fixtures
    @pytest.fixture
    def store_url(self) -> str:  # pragma: no cover - subclasses override
        raise NotImplementedError("subclasses provide a store_url fixture")

    @pytest.fixture
    def store(self, store_url: str):
        s = open_store(store_url, **self.open_options)
        yield s
        s.close()

    def reopen(self, store: KVStore, url: str, **options: Any) -> KVStore:
        """Close ``store`` and open the same URL again."""
        store.close()
        return open_store(url, **{**self.open_options, **options})

    # ----------------------------------------------------------------- basics
    def test_put_get(self, store: KVStore) -> None:
        store.put(b"a", b"1")
        assert store.get(b"a") == b"1"
        assert store.get(b"missing") is None
        assert store.get(b"missing", b"dflt") == b"dflt"
        assert b"a" in store and b"missing" not in store
        assert store[b"a"] == b"1"
        with pytest.raises(KeyNotFoundError):  # a KeyError, as for a dict
            store[b"missing"]

    def test_overwrite_and_delete(self, store: KVStore) -> None:
        store.put(b"k", b"old")
        store.put(b"k", b"new")
        assert store.get(b"k") == b"new"
        store.delete(b"k")
        assert store.get(b"k") is None
        store.delete(b"k")  # deleting an absent key is not an error

    def test_many(self, store: KVStore) -> None:
        items = {f"key{i:05d}".encode(): os.urandom(i % 97) for i in range(2500)}
        store.put_many(items)
        keys = list(items)[::-1] + [b"absent"]
        got = store.get_many(keys)
        assert got[-1] is None
        assert _as_bytes(got[:-1]) == [items[k] for k in keys[:-1]]
        store.delete_many(list(items)[:1000])
        assert store.count() == 1500
        assert store.get_many([]) == []
        store.put_many([])
        store.delete_many([])

    def test_put_many_pairs_and_buffers(self, store: KVStore) -> None:
        arr = np.arange(10, dtype=np.float32)
        store.put_many(
            [(b"b", bytearray(b"ba")), (b"m", memoryview(b"mv")), (b"n", arr), (b"e", b"")]
        )
        assert store.get(b"b") == b"ba"
        assert store.get(b"m") == b"mv"
        assert store.get(b"n") == arr.tobytes()
        assert store.get(b"e") == b""
        assert b"e" in store

    def test_binary_keys(self, store: KVStore) -> None:
        keys = [b"\x00", b"\x00\x00", b"\xff", b"\xff\xff\x00", b"a\x00b", bytes(range(256))]
        store.put_many({k: k[::-1] for k in keys})
        assert store.get_many(keys) == [k[::-1] for k in keys]

    def test_large_value(self, store: KVStore) -> None:
        big = os.urandom(self.large_value_bytes)
        store.put(b"big", big)
        assert bytes(store[b"big"]) == big

    # ----------------------------------------------------------------- scans
    def _fill(self, store: KVStore) -> dict[bytes, bytes]:
        items = {}
        for p in (b"a/", b"b/", b"b0", b"c/"):
            for i in range(30):
                items[p + b"%03d" % i] = p + b"v%d" % i
        items[b"b"] = b"bare"
        items[b"b/\xff\xff"] = b"hi"
        store.put_many(items)
        return items

    def _check_order(self, store: KVStore, keys: list[bytes]) -> list[bytes]:
        if store.capabilities.ordered_scans:
            assert keys == sorted(keys), "backend claims ordered scans"
            return keys
        return sorted(keys)

    def test_scan_prefix(self, store: KVStore) -> None:
        items = self._fill(store)
        got = list(store.scan(b"b/"))
        keys = self._check_order(store, [k for k, _ in got])
        expect = sorted(k for k in items if k.startswith(b"b/"))
        assert keys == expect
        assert all(bytes(v) == items[k] for k, v in got)
        assert sorted(store.scan(b"b/", keys_only=True)) == expect
        assert sorted(store.keys(b"c/")) == sorted(k for k in items if k.startswith(b"c/"))
        assert list(store.scan(b"zz")) == []
        everything = sorted(store.scan(keys_only=True))
        assert everything == sorted(items)

    def test_scan_range_and_limit(self, store: KVStore) -> None:
        items = self._fill(store)
        got = self._check_order(
            store, list(store.scan(start=b"a/010", stop=b"b/005", keys_only=True))
        )
        assert got == sorted(k for k in items if b"a/010" <= k < b"b/005")
        got = list(store.scan(b"a/", start=b"a/020", keys_only=True))
        assert sorted(got) == sorted(k for k in items if k.startswith(b"a/") and k >= b"a/020")
        limited = list(store.scan(b"c/", limit=7, keys_only=True))
        assert len(limited) == 7
        if store.capabilities.ordered_scans:
            assert limited == sorted(k for k in items if k.startswith(b"c/"))[:7]
        assert list(store.scan(b"c/", limit=0)) == []
        with pytest.raises(ValueError):
            list(store.scan(limit=-1))

    def test_scan_across_chunks(self, store: KVStore) -> None:
        """Scans longer than a backend's read step resume exactly after the last key."""
        n = 2 * STORE_SCAN_CHUNK + 37
        keys = [b"s/%06d" % i for i in range(n)]
        store.put_many({k: k[2:] for k in keys})
        store.put_many({b"r": b"before", b"t": b"after"})
        got = list(store.scan(b"s/"))
        assert sorted(k for k, _ in got) == keys
        assert len(got) == n
        assert all(bytes(v) == k[2:] for k, v in got)
        limit = STORE_SCAN_CHUNK + 5
        part = self._check_order(store, list(store.scan(b"s/", keys_only=True, limit=limit)))
        assert len(part) == limit and len(set(part)) == limit
        if store.capabilities.ordered_scans:
            assert part == keys[:limit]
        lo, hi = keys[STORE_SCAN_CHUNK - 3], keys[2 * STORE_SCAN_CHUNK + 1]
        ranged = self._check_order(store, list(store.scan(start=lo, stop=hi, keys_only=True)))
        assert ranged == [k for k in keys if lo <= k < hi]

    def test_paused_scan_lets_writes_through(self, store: KVStore) -> None:
        """An iterator left half-read must not block writers, and keeps working after them."""
        n = STORE_SCAN_CHUNK + 100
        keys = [b"p/%06d" % i for i in range(n)]
        store.put_many({k: b"x" for k in keys})
        it = store.scan(b"p/", keys_only=True)
        first = [next(it) for _ in range(10)]
        store.put_many({b"q/%04d" % i: os.urandom(64) for i in range(500)})
        doomed = set(keys[-50:])
        store.delete_many(sorted(doomed))
        store.delete_prefix(b"q/")
        rest = list(it)
        seen = first + rest
        if store.capabilities.ordered_scans:
            assert seen == sorted(seen)
            assert len(seen) == len(set(seen))
        # keys present for the whole scan come back; deleted ones may or may not
        assert set(keys) - doomed <= set(seen) <= set(keys)

    def test_count_and_delete_prefix(self, store: KVStore) -> None:
        items = self._fill(store)
        assert store.count() == len(items)
        assert store.count(b"b/") == 31
        assert store.delete_prefix(b"b/") == 31
        assert store.count(b"b/") == 0
        assert store.get(b"b") == b"bare" and store.get(b"b0000") == b"b0v0"
        assert store.count(b"b0") == 30
        assert store.delete_prefix(b"nothing") == 0

    # ----------------------------------------------------------------- batches
    def test_batch_applies_on_exit(self, store: KVStore) -> None:
        store.put(b"gone", b"x")
        with store.batch() as b:
            b.put(b"k1", b"v1")
            b.put_many({b"k2": b"v2", b"k3": b"v3"})
            b.delete(b"gone")
            b.put(b"k3", b"later wins")
            b.delete(b"k2")
            assert len(b) == 4
        assert store.get_many([b"k1", b"k2", b"k3", b"gone"]) == [b"v1", None, b"later wins", None]

    def test_batch_discarded_on_exception(self, store: KVStore) -> None:
        store.put(b"keep", b"old")
        with pytest.raises(RuntimeError), store.batch() as b:
            b.put(b"keep", b"new")
            b.put(b"other", b"x")
            raise RuntimeError("boom")
        assert store.get(b"keep") == b"old"
        assert store.get(b"other") is None

    # ----------------------------------------------------------------- bad input
    def test_bad_keys_and_values(self, store: KVStore) -> None:
        store.put(b"safe", b"1")
        with pytest.raises(KeyTypeError, match="str"):
            store.put("text", b"v")  # type: ignore[arg-type]
        with pytest.raises(EmptyKeyError):
            store.put(b"", b"v")
        with pytest.raises(KeyTypeError):
            store.put(12, b"v")  # type: ignore[arg-type]
        with pytest.raises(KeyTypeError, match="str"):
            store.put(b"k", "text")  # type: ignore[arg-type]
        with pytest.raises(KeyTypeError):
            store.put(b"k", 3.5)  # type: ignore[arg-type]
        with pytest.raises(KeyTypeError):
            store.get_many(b"single-bytes-not-a-list")  # type: ignore[arg-type]
        with pytest.raises(KeyTypeError):
            store.get_many([b"ok", None])  # type: ignore[list-item]
        # one bad item anywhere in a batch writes nothing
        with pytest.raises(EmptyKeyError):
            store.put_many([(b"x1", b"1"), (b"", b"2"), (b"x3", b"3")])
        assert store.get_many([b"x1", b"x3"]) == [None, None]
        with pytest.raises(KeyTypeError), store.batch() as b:
            b.put(b"y1", b"1")
            b.put(b"y2", "bad")  # type: ignore[arg-type]
        assert store.get(b"y1") is None
        assert store.get(b"safe") == b"1"

    def test_value_too_large(self, store: KVStore) -> None:
        limit = store.max_value_size
        if limit is None:
            pytest.skip("backend has no value size limit")
        store.put(b"k", b"old")
        # np.empty does not touch its pages, so this costs no memory until written.
        huge = np.empty(limit + 1, dtype=np.uint8)
        with pytest.raises(ValueTooLargeError, match=str(limit)):
            store.put(b"k", huge)
        assert store.get(b"k") == b"old"

    def test_readonly(self, store: KVStore, store_url: str) -> None:
        store.put(b"k", b"v")
        store.flush()
        if not self.persistent:
            pytest.skip("store does not survive reopening")
        ro = self.reopen(store, store_url, readonly=True)
        try:
            assert ro.get(b"k") == b"v"
            for op in (
                lambda: ro.put(b"k", b"x"),
                lambda: ro.delete(b"k"),
                lambda: ro.put_many({b"a": b"b"}),
                lambda: ro.delete_prefix(b"k"),
            ):
                with pytest.raises(ReadOnlyError, match="read-only"):
                    op()
            with pytest.raises(ReadOnlyError), ro.batch() as b:
                b.put(b"z", b"z")
            assert ro.get(b"k") == b"v" and ro.get(b"z") is None
        finally:
            ro.close()

    def test_use_after_close(self, store: KVStore) -> None:
        store.put(b"k", b"v")
        store.close()
        store.close()  # closing twice is harmless
        assert store.closed
        for op in (
            lambda: store.get(b"k"),
            lambda: store.put(b"k", b"v"),
            lambda: list(store.scan()),
            lambda: store.stats(),
            lambda: store.flush(),
        ):
            with pytest.raises(StoreClosedError, match="closed"):
                op()

    # ----------------------------------------------------------------- lifecycle
    def test_context_manager_and_stats(self, store_url: str) -> None:
        with open_store(store_url, **self.open_options) as s:
            s.put(b"k", b"v")
            st = s.stats()
            assert st["backend"] == s.scheme
            assert set(st["capabilities"]) >= {
                "ordered_scans", "atomic_batches", "durable_on_return", "multi_process",
            }
        assert s.closed

    def test_persistence(self, store: KVStore, store_url: str) -> None:
        if not self.persistent:
            pytest.skip("store does not survive reopening")
        store.put_many({b"p%d" % i: b"v%d" % i for i in range(100)})
        store.flush()
        again = self.reopen(store, store_url)
        try:
            assert again.count(b"p") == 100
            assert again.get(b"p42") == b"v42"
        finally:
            again.close()

    def test_capabilities_reported(self, store: KVStore) -> None:
        caps = store.capabilities
        assert store.stats()["capabilities"] == caps.as_dict()
        assert all(isinstance(v, bool) for v in caps.as_dict().values())

    def test_threads(self, store: KVStore) -> None:
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for r in range(20):
                    keys = [b"t%d/%d/%d" % (t, r, i) for i in range(50)]
                    store.put_many({k: k for k in keys})
                    assert _as_bytes(store.get_many(keys)) == keys
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert store.count(b"t") == 4 * 20 * 50

    # ----------------------------------------------------------------- atomic updates
    def test_compare_and_set(self, store: KVStore) -> None:
        assert store.put_if_absent(b"cas", b"a") is True
        assert store.put_if_absent(b"cas", b"b") is False
        assert store.get(b"cas") == b"a"
        assert store.compare_and_set(b"cas", b"x", b"c") is False  # wrong expectation
        assert store.compare_and_set(b"cas", b"a", b"c") is True
        assert store.get(b"cas") == b"c"
        assert store.compare_and_set(b"cas", b"c", None) is True  # delete
        assert store.get(b"cas") is None
        assert store.compare_and_set(b"cas", b"c", None) is False
        assert store.compare_and_set(b"cas-empty", None, b"") is True
        assert store.compare_and_set(b"cas-empty", b"", b"e") is True
        assert store.get(b"cas-empty") == b"e"
        with pytest.raises(KeyTypeError):
            store.compare_and_set("cas", None, b"a")  # type: ignore[arg-type]

    def test_put_first_absent(self, store: KVStore) -> None:
        """Numbered entries: the first free number from ``start``, ``before`` written too."""
        assert store.put_first_absent(b"log/", 0, b"e0", [(b"rec/0", b"r0")]) == 0
        assert store.put_first_absent(b"log/", 0, b"e1") == 1  # 0 is taken
        store.put(b"log/000000000003", b"other")
        assert store.put_first_absent(b"log/", 2, b"e2", [(b"rec/2", b"")]) == 2
        assert store.put_first_absent(b"log/", 2, b"e4") == 4
        assert store.get_many([b"log/000000000000", b"log/000000000002", b"rec/0", b"rec/2"]) \
            == [b"e0", b"e2", b"r0", b""]
        with pytest.raises(ValueError, match="start=-1"):
            store.put_first_absent(b"log/", -1, b"x")

    def test_compare_and_set_threads(self, store: KVStore) -> None:
        """Of many threads creating one key at once, exactly one succeeds."""
        for rnd in range(5):
            key = b"race/%d" % rnd
            wins: list[int] = []
            start = threading.Barrier(8)

            def work(t: int, key: bytes = key, wins: list[int] = wins,
                     start: threading.Barrier = start) -> None:
                start.wait()
                if store.put_if_absent(key, b"%d" % t):
                    wins.append(t)

            threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert len(wins) == 1, wins
            assert store.get(key) == b"%d" % wins[0]

    def test_value_sizes(self, store: KVStore) -> None:
        store.put_many({b"vs/a": b"abc", b"vs/b": b"", b"vs/c": b"x" * 1000})
        sizes = store.value_sizes([b"vs/a", b"vs/missing", b"vs/b", b"vs/c"])
        assert sizes.tolist() == [3, -1, 0, 1000]
        assert store.value_sizes([]).tolist() == []

    def test_identity_is_stable(self, store: KVStore) -> None:
        first = store.identity()
        store.put(b"ident", b"1")
        assert store.identity() == first

    # ----------------------------------------------------------------- processes
    def _run_child(self, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def test_multi_process(self, store: KVStore, store_url: str) -> None:
        if not (store.capabilities.multi_process and self.supports_subprocess):
            pytest.skip("backend is not shared between processes")
        store.put(b"from-parent", b"1")
        store.flush()
        r = self._run_child(
            f"""
            import tensorkv
            s = tensorkv.open_store({store_url!r}, **{self.open_options!r})
            assert s.get(b"from-parent") == b"1", s.get(b"from-parent")
            s.put(b"from-child", b"2")
            s.close()
            """
        )
        assert r.returncode == 0, r.stderr
        assert store.get(b"from-child") == b"2"

    def test_compare_and_set_processes(self, store: KVStore, store_url: str) -> None:
        """Of several processes creating one key at once, exactly one succeeds."""
        if not (store.capabilities.multi_process and self.supports_subprocess):
            pytest.skip("backend is not shared between processes")
        store.delete(b"race/proc")
        store.flush()
        code = textwrap.dedent(f"""
            import sys, time, tensorkv
            s = tensorkv.open_store({store_url!r}, **{self.open_options!r})
            go = float(sys.argv[1])
            time.sleep(max(0.0, go - time.time()))
            print(int(s.put_if_absent(b"race/proc", sys.argv[2].encode())))
            s.close()
        """)
        go = time.time() + 2.0
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(go), str(i)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(4)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
        won = [i for i, (out, _) in enumerate(outs) if out.strip() == "1"]
        assert len(won) == 1, outs
        assert store.get(b"race/proc") == str(won[0]).encode()

    def test_killed_mid_batch_is_all_or_nothing(self, store: KVStore, store_url: str) -> None:
        """A process killed inside a batch's commit leaves none of the batch behind.

        The child dies inside the backend's write (see
        :func:`tensorkv.testing.kill.kill_inside_next_write`) once half of the batch, then
        all of it but the commit, was handed to the backend.
        """
        if not (store.capabilities.atomic_batches and self.supports_subprocess):
            pytest.skip("backend does not claim atomic batches across processes")
        store.put(b"marker", b"before")
        store.flush()
        if not store.capabilities.multi_process:
            store.close()
        n, size = 20000, 512
        for at in (0.5, 1.0):
            code = f"""
                import os
                import tensorkv
                from tensorkv.testing.kill import kill_inside_next_write
                s = tensorkv.open_store({store_url!r}, **{self.open_options!r})
                payload = os.urandom({size})
                with s.batch() as b:
                    for i in range({n}):
                        b.put(b"batch/%06d" % i, payload)
                    b.put(b"marker", b"after")
                    try:
                        kill_inside_next_write(s, {at!r})
                    except NotImplementedError as exc:
                        print(exc, flush=True)
                        raise SystemExit(0)
                print("the batch was committed", flush=True)
            """
            r = self._run_child(code, timeout=120)
            if r.returncode == 0 and "no known seam" in r.stdout:
                pytest.skip(r.stdout.strip())
            assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
            check = open_store(store_url, **self.open_options)
            try:
                count = check.count(b"batch/")
                marker = check.get(b"marker")
            finally:
                check.close()
            assert (count, marker) == (0, b"before"), (
                f"killed after {at:.0%} of the batch went to the backend, before its commit: "
                f"{count} of {n} keys and marker {marker!r} are in the store"
            )

    def test_write_survives_sigkill(self, store: KVStore, store_url: str) -> None:
        """A write call that returned survives the writer being killed (process crash)."""
        if not (self.persistent and self.supports_subprocess):
            pytest.skip("store does not survive its process or cannot be opened by another")
        if not store.capabilities.multi_process:
            store.close()
        code = f"""
            import os, time
            import tensorkv
            s = tensorkv.open_store({store_url!r}, **{self.open_options!r})
            s.put_many({{b"kill/%03d" % i: b"v%d" % i for i in range(100)}})
            with s.batch() as b:
                b.put(b"kill/batch", b"done")
            print("written", flush=True)
            time.sleep(60)
        """
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == b"written\n", proc.stderr.read() if proc.stderr else line
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        check = open_store(store_url, **self.open_options)
        try:
            assert check.count(b"kill/") == 101
            assert check.get(b"kill/042") == b"v42"
            assert check.get(b"kill/batch") == b"done"
        finally:
            check.close()

    # ----------------------------------------------------------------- model check
    def test_matches_dict_model(self, store: KVStore) -> None:
        """Hypothesis stateful test: the store behaves like a dict under random operations."""
        from hypothesis import settings
        from hypothesis.stateful import run_state_machine_as_test

        from tensorkv.testing.model import make_dict_machine

        store.delete_prefix(b"")
        machine = make_dict_machine(store)
        run_state_machine_as_test(
            machine, settings=settings(max_examples=25, stateful_step_count=30, deadline=None)
        )
