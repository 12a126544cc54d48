"""One local Ray for the parameter-server tests (2 CPUs, no dashboard, loopback), stopped after.

Shard actors use ``num_cpus=0``, so two CPUs run any number of them. Each test module gets
its own parameter server; they all share the one Ray started here for the session.
"""

import itertools
import uuid

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray on 127.0.0.1 for the session (tensorkv's own start); shut down at the end."""
    from tensorkv.distributed import start_local_ray

    start_local_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ps(ray_cluster):
    """A 2-shard parameter server without checkpoints, for the module."""
    from tensorkv.distributed import ParameterServer

    server = ParameterServer(2, name=f"test-{uuid.uuid4().hex[:8]}")
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def table_names():
    """Fresh table names."""
    return (f"t{i}" for i in itertools.count())
