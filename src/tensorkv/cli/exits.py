"""Exit statuses of the ``tensorkv`` command: one mapping from an error to a status.

Every command exits through :func:`exit_code_of` (``cli/main.py`` applies it to whatever a
command raises), so the same error gives the same status in every command. The table is in
docs/viewer.md ("Exit statuses") and in ``tensorkv --help``.
"""

from __future__ import annotations

from tensorkv.errors import (
    BadIndexError,
    ConfigError,
    EmptyKeyError,
    InvalidURLError,
    KeyNotFoundError,
    KeyTypeError,
    ModelNotFoundError,
    QueryError,
    RowNotFoundError,
    StoreNotFoundError,
    TagNotFoundError,
    TensorKVError,
    TensorNotFoundError,
    VariableNotFoundError,
)

EXIT_OK = 0
#: A negative answer, not an error: ``search`` matched no row, ``diff --exit-code`` found
#: differences, ``check`` / ``repo check`` found missing, corrupt or orphaned data.
EXIT_NO_MATCH = 1
#: Bad option or argument: malformed URL, predicate, slice, vector or key; a bad setting.
EXIT_USAGE = 2
#: No such store, tag, variable, model, tensor, or row of the key asked for.
EXIT_NOT_FOUND = 3
#: The operation failed: the store was unreachable, refused, locked, full or damaged, a
#: save was refused, a missing optional dependency, an I/O error.
EXIT_STORE = 4
#: An unexpected error (a bug: the message asks to report it).
EXIT_INTERNAL = 5

#: The statuses, as ``--help`` prints them.
EPILOG = ("Exit status: 0 ok; 1 a negative answer (search matched nothing, diff --exit-code "
          "found differences, check found damage); 2 usage error; 3 store, tag, variable, "
          "model or key not found; 4 the operation failed (store unreachable, refused or "
          "damaged; I/O error); 5 unexpected error. Errors print one line on stderr; "
          "TENSORKV_DEBUG=1 shows the traceback instead.")

#: Modules whose exceptions are the storage libraries' own (errors tensorkv did not wrap).
BACKEND_MODULES = ("lmdb", "plyvel", "rocksdict", "redis")

_NOT_FOUND = (TagNotFoundError, VariableNotFoundError, StoreNotFoundError, RowNotFoundError,
              ModelNotFoundError, TensorNotFoundError, KeyNotFoundError)
_USAGE = (QueryError, BadIndexError, InvalidURLError, ConfigError, KeyTypeError, EmptyKeyError)


def exit_code_of(exc: BaseException) -> int:
    """The exit status that stands for ``exc`` (see the ``EXIT_*`` constants).

    A ``click.ClickException`` stands for the exception it was raised from, if any; one
    raised by a command on its own is a failed operation, unless it carries its own status.
    """
    import click

    if isinstance(exc, click.UsageError):
        return EXIT_USAGE
    if isinstance(exc, click.ClickException):
        cause = exc.__cause__
        if isinstance(cause, Exception) and not isinstance(cause, click.ClickException):
            return exit_code_of(cause)
        return exc.exit_code if exc.exit_code not in (0, 1) else EXIT_STORE
    if isinstance(exc, _NOT_FOUND):
        return EXIT_NOT_FOUND
    if isinstance(exc, _USAGE):
        return EXIT_USAGE
    if isinstance(exc, (TensorKVError, OSError, MemoryError)):
        return EXIT_STORE
    if type(exc).__module__.split(".")[0] in BACKEND_MODULES:
        return EXIT_STORE
    return EXIT_INTERNAL


__all__ = ["BACKEND_MODULES", "EPILOG", "EXIT_INTERNAL", "EXIT_NOT_FOUND", "EXIT_NO_MATCH",
           "EXIT_OK", "EXIT_STORE", "EXIT_USAGE", "exit_code_of"]
