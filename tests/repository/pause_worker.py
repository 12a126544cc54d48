"""A process that deletes a model and stops itself (SIGSTOP) at a chosen point of the delete.

``python -m repository.pause_worker URL MID WHERE [HOST]``: ``WHERE`` is ``data`` (stop with
the tombstones written, before any data is deleted) or ``lock`` (stop while holding the
reference-count lock); ``HOST`` makes the process name another host in what it writes, so
other processes cannot check whether it runs. Prints the number of tensors it retired.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from tensorkv import Repository


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def main(url: str, mid: str, where: str, host: str = "") -> None:
    """Delete model ``mid`` of the repository at ``url``, stopping at ``where``."""
    if host:
        socket.gethostname = lambda: host  # type: ignore[assignment]
    repo = Repository(url)
    if where == "data":
        delete_data = repo.delete_data

        def stop_then_delete(*args, **kwargs):
            _stop()
            return delete_data(*args, **kwargs)

        repo.delete_data = stop_then_delete  # type: ignore[method-assign]
    else:
        get_many = repo.meta.get_many
        stopped: list[bool] = []

        def stop_in_lock(keys):
            if not stopped and keys and keys[0].startswith(b"repo/r/"):
                stopped.append(True)  # its first read of counts: the lock is held
                _stop()
            return get_many(keys)

        repo.meta.get_many = stop_in_lock  # type: ignore[method-assign]
    print(repo.delete(mid), flush=True)
    repo.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
