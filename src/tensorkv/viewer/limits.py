"""How much input the viewer accepts: longer or deeper input is refused, naming the limit.

Every text a person or a web request hands the viewer is bounded before it is parsed: a
predicate (its length and how deep its brackets and ``not`` nest), a tag, a variable name, a
slice, a key. The checks raise :class:`~tensorkv.errors.QueryError` (``tensorkv`` commands
exit 2, the web API answers 400) whose message names the limit, so no input can make a parser
recurse without bound, hold megabytes of text, or come back whole inside an error message:
errors show at most :data:`SHOWN_CHARS` characters of what they refuse (:func:`shown`).

The web API also bounds every request parameter (``tensorkv.viewer.web.api``).

Examples
--------
>>> check_length("predicate", "freq >= 1", MAX_PREDICATE_CHARS)
'freq >= 1'
>>> shown("x" * 100)
"'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (100 characters)"
"""

from __future__ import annotations

from tensorkv.errors import CheckpointError, QueryError

#: Characters of a ``--where`` predicate (below the 4,300 digits Python parses into an int).
MAX_PREDICATE_CHARS = 4096
#: Brackets and ``not`` nested inside each other in a predicate (``not (not (freq > 1))``
#: nests 3 deep); ``and`` / ``or`` chains of any length do not nest.
MAX_PREDICATE_DEPTH = 32
#: Bytes (UTF-8) of a tag name: the longest tag a save accepts.
MAX_TAG_BYTES = 200
#: Bytes (UTF-8) of a variable name the viewer looks up.
MAX_NAME_BYTES = 1024
#: Characters of a slice of a dense tensor (``--slice``, ``slice=``).
MAX_SLICE_CHARS = 1024
#: Characters of one key, number or integer option (an int64 takes at most 20).
MAX_NUMBER_CHARS = 64
#: Characters of a refused input that an error message shows.
SHOWN_CHARS = 60


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(text)``, cut to ``limit`` characters (with the full length) when longer."""
    if isinstance(text, str) and len(text) > limit:
        return f"{text[:limit]!r}... ({len(text)} characters)"
    return repr(text)


def check_length(what: str, text: str, limit: int, unit: str = "characters") -> str:
    """``text`` when it holds at most ``limit`` characters (``unit="bytes"``: UTF-8 bytes).

    Raises
    ------
    QueryError
        The text is longer; the message names ``what``, its length and the limit.
    """
    size = len(text.encode("utf-8", "surrogatepass")) if unit == "bytes" else len(text)
    if size > limit:
        head = text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else "")
        raise QueryError(f"{what} {head!r} is {size} {unit} long; the viewer accepts at "
                         f"most {limit} {unit}", text, limit)
    return text


def check_tag(tag: object) -> str:
    """A tag name to look up: a str of at most :data:`MAX_TAG_BYTES` bytes that a save allows.

    Raises
    ------
    QueryError
        Not a str, too long, or a name no save can have (``/``, ``~``, braces, NUL).
    """
    if not isinstance(tag, str):
        raise QueryError(f"tag {shown(tag)} must be a str such as 'step-100'")
    check_length("tag", tag, MAX_TAG_BYTES, "bytes")
    _check_text("tag", tag)
    from tensorkv.checkpoint import layout

    try:
        layout.check_tag(tag)
    except CheckpointError as exc:
        raise QueryError(f"{exc}; no tag has such a name", tag, None) from None
    return tag


def check_name(name: object) -> str:
    """A variable name to look up: a str of at most :data:`MAX_NAME_BYTES` bytes.

    Raises
    ------
    QueryError
        Not a str, too long, or not UTF-8 text.
    """
    if not isinstance(name, str):
        raise QueryError(f"variable name {shown(name)} must be a str")
    check_length("variable name", name, MAX_NAME_BYTES, "bytes")
    return _check_text("variable name", name)


def _check_text(what: str, text: str) -> str:
    """Refuse text that is not UTF-8 (a command-line argument of undecodable bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise QueryError(f"{what} {shown(text)} holds {text[exc.start]!r} at character "
                         f"{exc.start}, which is not UTF-8 text; no name holds it", text,
                         exc.start) from None
    return text
