"""A Ray on this machine that only this machine can reach: :func:`start_local_ray`.

Ray started by ``ray.init()`` on Linux serves on the machine's network address: its GCS,
raylet, object manager and every worker's gRPC server accept connections from any host that
reaches it. A local Ray started by tensorkv takes the loopback address as the node's address
instead, so every one of those servers listens on ``127.0.0.1`` only, and starts no dashboard
unless asked. Ray takes the node's address from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its
single-machine mode; set in this process's environment, so processes started from it, such as
other drivers attaching with ``ray.init(address=...)``, use it too).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from tensorkv.errors import import_optional

#: Ray's switch to its single-machine mode (the node's address is the loopback address).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: The address a local Ray started by tensorkv serves on.
LOOPBACK = "127.0.0.1"


def start_local_ray(num_cpus: int | None = None, *, dashboard: bool = False,
                    **options: Any) -> bool:
    """Start a local Ray that listens on the loopback address only (unless one runs).

    Parameters
    ----------
    num_cpus
        CPUs Ray may schedule (default: the machine's).
    dashboard
        Start Ray's dashboard (on ``127.0.0.1:8265``); off by default.
    **options
        More ``ray.init`` arguments (``object_store_memory``, ``_temp_dir`` ...).

    Returns
    -------
    bool
        Whether Ray was started now (False: this process runs or joined one already, or
        ``RAY_ADDRESS`` names a cluster, which ``ray.init`` then joins).

    Examples
    --------
    Not run as a doctest (it starts a local Ray cluster, which takes seconds);
    tests/distributed starts one the same way.

    >>> from tensorkv.distributed import start_local_ray            # doctest: +SKIP
    >>> start_local_ray(num_cpus=2)                                  # doctest: +SKIP
    True
    """
    joining = bool(os.environ.get("RAY_ADDRESS"))
    if not joining:
        os.environ[LOOPBACK_ENV] = "0"  # read when ray is imported; children inherit it
    ray = import_optional("ray", "the parameter server (tensorkv.distributed)", "ray")
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False, **options}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if joining:
        ray.init(**kwargs)
        return False
    kwargs.setdefault("include_dashboard", bool(dashboard))
    if dashboard:
        kwargs.setdefault("dashboard_host", LOOPBACK)
    # ray imported before the variable was set read it already: set what it read from it
    consts: Any = importlib.import_module("ray._private.ray_constants")
    before = consts.ENABLE_RAY_CLUSTER
    consts.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**kwargs)
    finally:
        consts.ENABLE_RAY_CLUSTER = before
    return True


__all__ = ["LOOPBACK", "LOOPBACK_ENV", "start_local_ray"]
