"""Fixtures and lanes shared by every test package.

Shared servers (one of each per test process; with ``pytest -n`` each worker has its own):

- ``redis_server``: a plain standalone redis-server; ``redis_tls_server`` (mutual TLS) and
  ``redis_acl_server`` (user ``app`` / password ``s3cret``).
- ``redis_cluster``: a Redis Cluster of 3 masters, no replicas.
- ``redis_sentinel``: a master, a replica and three sentinels for service ``mymaster``.

They start on first use and stop when the session ends. Tests share them by key prefix (a
fresh one per test: ``servers.prefix()``); a test that kills, restarts or reconfigures a server
starts its own (``servers.RedisServer(...)``), never a shared one.

Lanes: tests listed in ``SLOW`` below are marked ``slow`` (``make test-fast`` leaves them
out). With ``pytest -n N --dist loadgroup`` (``make test``), one worker runs every test listed
in ``GROUPS["ray"]`` on one local Ray, started first since it is the longest unit; every other
test goes to whichever worker is free.
"""

from __future__ import annotations

import os

import pytest

import servers

os.environ.setdefault("TENSORKV_PROGRESS", "0")

#: The ``slow`` tests (still run by ``make test``), with the reason. A key with ``/`` is a
#: node-id prefix (a file, a test, one parametrized case); a bare name is a test function of
#: that name anywhere (the conformance suites run it once per backend).
SLOW: dict[str, str] = {
    # processes killed with SIGKILL mid-write, then the store checked
    "tests/checkpoint/test_crash.py": "savers SIGKILLed mid-save on every backend",
    "tests/faults/test_kill_saver.py": "savers SIGKILLed at seeded points",
    "tests/faults/test_kill_background_save.py": "background saves SIGKILLed",
    "tests/faults/test_shard_crash.py": "shard processes SIGKILLed mid-run",
    "tests/repository/test_kill.py": "repository writers SIGKILLed at every store call",
    "tests/tiers/test_crash.py": "tier chains SIGKILLed mid-flush",
    "tests/redis_table/test_commits.py::test_writer_sigkilled_mid_operation":
        "trainers SIGKILLed mid-commit",
    "tests/redis_table/test_commits.py::test_cluster_master_killed_mid_commit":
        "a Cluster master SIGKILLed and restarted",
    "test_write_survives_sigkill": "a writer process SIGKILLed (every store)",
    "test_killed_mid_batch_is_all_or_nothing": "a writer process SIGKILLed (every store)",
    "test_hash_tag_batch_is_atomic_when_killed": "a writer process SIGKILLed",
    "tests/repository/test_pause.py": "repository processes stopped and killed",
    # servers killed, restarted, failed over; disks filled; files damaged byte by byte
    "tests/faults/test_redis_faults.py": "redis-servers killed, restarted, failed over",
    "tests/redis_table/test_faults.py": "redis-servers killed, a Sentinel failover",
    "tests/redis_table/test_lost_data.py": "redis-servers restarted empty, failovers",
    "tests/faults/test_durable.py": "fsync traced on every backend",
    "tests/faults/test_full_disk.py": "saves into a full file system",
    "tests/stores/test_damaged.py": "every store file damaged in turn",
    # several processes at once
    "tests/faults/test_concurrent_savers.py": "four saver processes race",
    "tests/redis_table/test_concurrency.py": "four writer processes",
    "tests/redis_table/test_saves.py": "a trainer process beside the saves",
    "tests/checkpoint/test_sharded.py::test_parallel_sharded_save_and_reshard":
        "shard saver processes",
    "test_multi_process": "writer processes (every store)",
    "test_compare_and_set_processes": "processes racing (every store)",
    "test_hashes_stable_across_processes_and_seeds": "child interpreters",
    "tests/repository/test_concurrency.py": "threads and processes on one repository",
    "tests/checkpoint/test_snapshot_saves.py::test_saves_from_another_thread_record_one_state":
        "saves racing training threads on every tier chain",
    # long runs: benchmarks end to end, randomized models, damaged-file sweeps
    "tests/checkpoint/test_bench_smoke.py": "the checkpoint benchmarks end to end",
    "tests/repository/test_bench_smoke.py": "the repository benchmark end to end",
    "tests/redis_table/test_bench_smoke.py": "the Redis-table benchmark end to end",
    "tests/test_bench_kv_smoke.py": "the key-value benchmark end to end",
    "tests/tiers/test_bench_tiers_smoke.py": "the tier benchmark end to end",
    "tests/embedding/test_bench_table_smoke.py": "the table benchmark end to end",
    "tests/test_cli.py::test_bench_kv_tiny_json": "the key-value benchmark from the CLI",
    "tests/test_bench_train_smoke.py": "the training benchmark end to end",
    "tests/viewer/test_viewer_bench.py": "the viewer benchmark end to end",
    "tests/viewer_web/test_web_scripts.py": "the web viewer's screenshot and benchmark scripts",
    "tests/test_demo.py": "the demo end to end: trains, checkpoints, resumes",
    "tests/torch/test_parity.py::test_dynamic_bag_trains_like_static_sparse_bag":
        "trains a model per optimizer and tier against torch",
    "tests/torch/test_parity.py::test_training_continues_identically_after_restore_in_a_fresh_process":
        "trains, saves, and trains on in a child interpreter",
    "tests/test_docs.py::test_doc_block_runs": "runs every code block of the docs",
    "test_matches_dict_model": "a long randomized model run (every store)",
    # the browser
    "tests/viewer_web/test_web_browser.py": "drives chromium",
}

#: Tests that use one of these fixtures are ``slow``.
SLOW_FIXTURES: dict[str, str] = {
    "ray_cluster": "starts a local Ray (about 10 s) and parameter-server actors",
}

#: Groups of tests that one xdist worker runs, by node-id prefix: the tests that start or use
#: a local Ray (one Ray per worker would start several at once on a small machine), and
#: tests that share an expensive module-level result.
GROUPS: dict[str, tuple[str, ...]] = {
    "ray": ("tests/distributed/",
            "tests/test_docs.py::test_doc_block_runs[docs/distributed.md"),
    # its first test builds the import graph of src/ (seconds), which the others reuse
    "architecture": ("tests/test_architecture.py",),
}


def _matches(nodeid: str, prefix: str) -> bool:
    """Whether ``prefix`` names ``nodeid``: a folder, file, test, or the start of a case id."""
    return nodeid == prefix or (nodeid.startswith(prefix) and (
        prefix.endswith("/") or "[" in prefix or nodeid[len(prefix)] in ":["))


def group_of(nodeid: str) -> str | None:
    """The name of the ``GROUPS`` entry that holds test ``nodeid``, or None."""
    return next((name for name, prefixes in GROUPS.items()
                 if any(nodeid.startswith(p) for p in prefixes)), None)


def is_slow(item: pytest.Item) -> bool:
    """Whether ``SLOW`` or ``SLOW_FIXTURES`` make ``item`` a slow test."""
    name = getattr(item, "originalname", item.name)
    fixtures = getattr(item, "fixturenames", ())
    return (name in SLOW or any(_matches(item.nodeid, p) for p in SLOW if "/" in p)
            or any(f in SLOW_FIXTURES for f in fixtures))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``SLOW`` tests slow."""
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist installed, schedule ``--dist loadgroup`` by ``GROUPS``."""
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_GroupScheduling(), "tensorkv-test-groups")


class _GroupScheduling:
    """``--dist loadgroup`` by ``GROUPS``: one work unit per group, one per other test.

    pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming test ids, which
    pytest 9 no longer allows; this scheduler reads the groups from the ids instead.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            # xdist sorts units by size (--loadscope-reorder), so a group starts first
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid) or nodeid

        return Scheduling(config, log)


@pytest.fixture(scope="session")
def redis_server(request):
    """A plain standalone redis-server for the session (skips if none is installed)."""
    return servers.session_server(request, servers.RedisServer)


@pytest.fixture(scope="session")
def redis_tls_server(request):
    """A TLS-only redis-server that requires client certificates."""
    return servers.session_server(request, servers.RedisServer, tls=True)


@pytest.fixture(scope="session")
def redis_acl_server(request):
    """A redis-server whose default user is disabled; user ``app`` / password ``s3cret``."""
    return servers.session_server(request, servers.RedisServer, username="app", password="s3cret")


@pytest.fixture(scope="session")
def redis_cluster(request):
    """A Redis Cluster of 3 masters (no replicas), shared by key prefix."""
    return servers.session_server(request, servers.RedisCluster)


@pytest.fixture(scope="session")
def redis_sentinel(request):
    """A master, a replica and three sentinels (quorum 2) for service ``mymaster``."""
    return servers.session_server(request, servers.RedisSentinel)


@pytest.fixture(autouse=True)
def _no_redis_config_env(monkeypatch):
    """Keep the Redis config variables of the caller's shell (ours, TFRA's) out of the tests."""
    for name in ("TENSORKV_REDIS_CONFIG_PATH", "TFRA_REDIS_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
