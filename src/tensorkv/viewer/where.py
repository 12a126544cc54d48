"""The predicate language of ``--where``: a tokenizer, a recursive-descent parser, numpy masks.

Grammar (keywords are case-insensitive; ``&&``, ``||`` and ``!`` are accepted for ``and``,
``or`` and ``not``)::

    expr    := and ("or" and)*
    and     := not ("and" not)*
    not     := "not" not | primary
    primary := "(" expr ")" | compare
    compare := operand (op operand)+          # chains: 0.1 < norm <= 1
             | FIELD "in" "[" NUMBER ("," NUMBER)* "]"
    operand := FIELD | NUMBER                 # NUMBER: 10, -3, 0.5, 1e-3, inf, -inf, nan
    op      := "==" | "=" | "!=" | "<" | "<=" | ">" | ">="

Fields, per row: ``key``, ``freq`` (lookups counted), ``version`` (step of the last update),
``norm`` (L2 norm of the value), ``slot_norm`` (L2 norm of the optimizer slots),
``absmax`` (largest absolute value) and ``finite`` (1 when every value is finite, else 0).
Integers compare exactly with the int64 fields. The text is never evaluated as Python: it is
compiled into a tree of numpy operations, and a malformed text raises
:class:`~tensorkv.errors.QueryError` whose ``position`` is the offending character. A text
longer than :data:`~tensorkv.viewer.limits.MAX_PREDICATE_CHARS` characters, or whose brackets
and ``not`` nest deeper than :data:`~tensorkv.viewer.limits.MAX_PREDICATE_DEPTH`, is refused
the same way; ``and`` and ``or`` chains of any length build one flat node each, so nothing
the parser accepts recurses deeper than that when it is evaluated.

Examples
--------
>>> p = parse_predicate("freq >= 10 and norm < 0.1 or not (version == 3)")
>>> sorted(p.fields)
['freq', 'norm', 'version']
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv.checkpoint.tables import Rows
from tensorkv.errors import QueryError
from tensorkv.viewer.limits import MAX_PREDICATE_CHARS, MAX_PREDICATE_DEPTH, check_length, shown

#: Field name -> what it is (for help texts and error messages).
FIELDS = {
    "key": "the row's int64 key",
    "freq": "how many times the key was looked up",
    "version": "the step of the row's last update",
    "norm": "L2 norm of the value (float32)",
    "slot_norm": "L2 norm of the optimizer slots (float32; 0 without slots)",
    "absmax": "largest absolute value of the row (float32)",
    "finite": "1 when every value is finite, else 0",
}
_INT_FIELDS = {"key", "freq", "version", "finite"}

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq, "=": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
_FLIP = {"==": "==", "=": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)(?![A-Za-z_\d])
          |[+-](?i:inf|nan)(?![A-Za-z_\d]))
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>==|!=|<=|>=|&&|\|\||[<>=!()\[\],])
""", re.VERBOSE)
_WORDS = {"and": "and", "or": "or", "not": "not", "in": "in"}
_SYMBOLS = {"&&": "and", "||": "or", "!": "not"}
_NUM_WORDS = {"inf": math.inf, "nan": math.nan}


@dataclass(frozen=True)
class Token:
    """One token: its kind (``num``, ``field``, ``op``, a keyword, ``end``), text, position."""

    kind: str
    text: str
    pos: int
    value: Any = None


def _fail(text: str, pos: int, why: str) -> QueryError:
    near = text[pos:pos + 12] or "the end"
    return QueryError(
        f"predicate {shown(text)}: {why} at character {pos} (near {near!r}); fields are "
        f"{', '.join(FIELDS)}, e.g. 'freq >= 10 and norm < 0.1'", text, pos,
    )


def tokenize(text: str) -> list[Token]:
    """The tokens of a predicate, ending with an ``end`` token.

    Raises
    ------
    QueryError
        A character that starts no token, or an unknown name.
    """
    out: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _fail(text, pos, f"unexpected character {text[pos]!r}")
        kind = m.lastgroup
        tok = m.group()
        if kind == "num":
            out.append(Token("num", tok, pos, _number(tok)))
        elif kind == "name":
            low = tok.lower()
            if low in _WORDS:
                out.append(Token(_WORDS[low], tok, pos))
            elif low in _NUM_WORDS:
                out.append(Token("num", tok, pos, _NUM_WORDS[low]))
            elif low in FIELDS:
                out.append(Token("field", low, pos))
            else:
                raise _fail(text, pos, f"unknown field {shown(tok)}")
        elif kind == "op":
            if tok in _SYMBOLS:
                out.append(Token(_SYMBOLS[tok], tok, pos))
            else:
                out.append(Token("op" if tok in _OPS else tok, tok, pos))
        pos = m.end()
    out.append(Token("end", "", len(text)))
    return out


def _number(tok: str) -> int | float:
    if re.fullmatch(r"[+-]?\d+", tok):
        v = int(tok)
        return v
    return float(tok)


# ------------------------------------------------------------------ the tree
#: ("or", a, b, ...) | ("and", a, b, ...) | ("not", a) | ("cmp", op, lhs, rhs) | ("in", f, vals):
#: "or" and "and" hold every operand of a chain (flat, whatever its length).
Node = tuple


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = tokenize(text)
        self.i = 0
        self.depth = 0  # brackets and 'not' open around the token being parsed

    def nest(self, tok: Token) -> None:
        """Enter a bracket or a 'not'; refuse nesting deeper than MAX_PREDICATE_DEPTH."""
        self.depth += 1
        if self.depth > MAX_PREDICATE_DEPTH:
            raise _fail(self.text, tok.pos, f"brackets and 'not' nest more than "
                        f"{MAX_PREDICATE_DEPTH} levels deep (the most the viewer accepts)")

    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def take(self, kind: str) -> Token:
        t = self.tok
        if t.kind != kind:
            raise _fail(self.text, t.pos, f"expected {_describe(kind)}, found "
                        f"{_describe(t.kind, t.text)}")
        self.i += 1
        return t

    def parse(self) -> Node:
        if self.tok.kind == "end":
            raise _fail(self.text, 0, "the predicate is empty")
        node = self.expr()
        if self.tok.kind != "end":
            found = _describe(self.tok.kind, self.tok.text)
            raise _fail(self.text, self.tok.pos,
                        f"unexpected {found}; expected 'and', 'or' or the end")
        return node

    def expr(self) -> Node:
        parts = [self.conj()]
        while self.tok.kind == "or":
            self.i += 1
            parts.append(self.conj())
        return _chain("or", parts)

    def conj(self) -> Node:
        parts = [self.neg()]
        while self.tok.kind == "and":
            self.i += 1
            parts.append(self.neg())
        return _chain("and", parts)

    def neg(self) -> Node:
        if self.tok.kind == "not":
            self.nest(self.tok)
            self.i += 1
            node = ("not", self.neg())
            self.depth -= 1
            return node
        return self.primary()

    def primary(self) -> Node:
        if self.tok.kind == "(":
            self.nest(self.tok)
            self.i += 1
            node = self.expr()
            self.take(")")
            self.depth -= 1
            return node
        return self.compare()

    def operand(self) -> Token:
        t = self.tok
        if t.kind not in ("field", "num"):
            raise _fail(self.text, t.pos, f"expected a field or a number, found "
                        f"{_describe(t.kind, t.text)}")
        self.i += 1
        return t

    def compare(self) -> Node:
        first = self.operand()
        if self.tok.kind == "in":
            if first.kind != "field":
                raise _fail(self.text, first.pos, "'in' needs a field on its left")
            self.i += 1
            self.take("[")
            vals = [self.take("num").value]
            while self.tok.kind == ",":
                self.i += 1
                vals.append(self.take("num").value)
            self.take("]")
            return ("in", first.text, tuple(vals))
        if self.tok.kind != "op":
            raise _fail(self.text, self.tok.pos, f"expected a comparison (==, !=, <, <=, >, >=) "
                        f"after {shown(first.text)}, found "
                        f"{_describe(self.tok.kind, self.tok.text)}")
        parts: list[Node] = []
        lhs = first
        while self.tok.kind == "op":
            op = self.take("op").text
            rhs = self.operand()
            if lhs.kind == "num" and rhs.kind == "num":
                raise _fail(self.text, lhs.pos, "a comparison needs a field on one side")
            parts.append(("cmp", op, _operand(lhs), _operand(rhs)))
            lhs = rhs
        return _chain("and", parts)


def _chain(kind: str, parts: list[Node]) -> Node:
    """One node of ``kind`` ("and"/"or") over ``parts``; a single part stands alone."""
    return parts[0] if len(parts) == 1 else (kind, *parts)


def _operand(t: Token) -> tuple[str, Any]:
    return ("field", t.text) if t.kind == "field" else ("num", t.value)


def _describe(kind: str, text: str = "") -> str:
    if kind == "end":
        return "the end"
    if kind in ("num", "field", "op"):
        return {"num": "a number", "field": "a field", "op": "a comparison"}[kind] + (
            f" {shown(text)}" if text else "")
    return shown(text or kind)


# ------------------------------------------------------------------ per-row fields
def row_norms(values: np.ndarray) -> np.ndarray:
    """L2 norm of each row, float32 (accumulated in float32, as every viewer query does)."""
    v = values if values.dtype == np.float32 else values.astype(np.float32)
    if v.ndim != 2 or v.shape[1] == 0:
        return np.zeros(v.shape[0], np.float32)
    return np.sqrt(np.einsum("ij,ij->i", v, v))


def field_values(rows: Rows, field: str) -> np.ndarray:
    """One field of every row of ``rows`` (see :data:`FIELDS`)."""
    if field == "key":
        return rows.keys
    if field in ("freq", "version"):
        return rows.freq if field == "freq" else rows.version
    if field == "norm":
        return row_norms(rows.values)
    if field == "slot_norm":
        return row_norms(rows.slots)
    v = rows.values if rows.values.dtype == np.float32 else rows.values.astype(np.float32)
    if field == "absmax":
        return np.abs(v).max(axis=1) if v.shape[1] else np.zeros(v.shape[0], np.float32)
    if field == "finite":
        return np.isfinite(v).all(axis=1).astype(np.int64)
    raise QueryError(f"unknown field {field!r}; fields are {', '.join(FIELDS)}")


class Predicate:
    """A parsed predicate: call it on rows to get a boolean mask.

    Attributes
    ----------
    text
        The source text.
    fields
        The fields it reads (``norm`` needs the values, ``slot_norm`` the slots).
    """

    def __init__(self, text: str):
        check_length("predicate", text, MAX_PREDICATE_CHARS)
        self.text = text
        self.tree = _Parser(text).parse()
        self.fields = frozenset(_fields(self.tree))
        for node in _compares(self.tree):  # literal checks: int range of int fields
            _check_literals(text, node)

    def __repr__(self) -> str:
        return f"Predicate({self.text!r})"

    def __call__(self, rows: Rows) -> np.ndarray:
        """Boolean mask over ``rows``: which rows satisfy the predicate."""
        cache: dict[str, np.ndarray] = {}

        def get(f: str) -> np.ndarray:
            if f not in cache:
                cache[f] = field_values(rows, f)
            return cache[f]

        out = _eval(self.tree, get)
        n = rows.keys.shape[0]
        return np.broadcast_to(out, (n,)).copy() if np.ndim(out) == 0 else out


def _fields(node: Node) -> set[str]:
    kind = node[0]
    if kind in ("or", "and"):
        return set().union(*(_fields(n) for n in node[1:]))
    if kind == "not":
        return _fields(node[1])
    if kind == "in":
        return {node[1]}
    return {v for k, v in node[2:] if k == "field"}


def _compares(node: Node) -> list[Node]:
    kind = node[0]
    if kind in ("or", "and"):
        return [c for n in node[1:] for c in _compares(n)]
    if kind == "not":
        return _compares(node[1])
    return [node]


def _check_literals(text: str, node: Node) -> None:
    if node[0] == "in":
        field, vals = node[1], node[2]
        if field in _INT_FIELDS and any(isinstance(v, int) and not -(2**63) <= v < 2**63
                                        for v in vals):
            raise QueryError(f"predicate {shown(text)}: a value of 'in' is outside int64",
                             text, 0)
        return
    for k, v in node[2:]:
        if k == "num" and isinstance(v, int) and not -(2**63) <= v < 2**63:
            digits = str(v)
            num = digits if len(digits) <= 40 else f"{digits[:40]}... ({len(digits)} digits)"
            raise QueryError(f"predicate {shown(text)}: the number {num} is outside the int64 "
                             "range", text, text.find(digits))


def _eval(node: Node, get: Callable[[str], np.ndarray]) -> Any:
    kind = node[0]
    if kind in ("or", "and"):
        combine = np.logical_or if kind == "or" else np.logical_and
        out = _eval(node[1], get)
        for part in node[2:]:
            out = combine(out, _eval(part, get))
        return out
    if kind == "not":
        return np.logical_not(_eval(node[1], get))
    if kind == "in":
        col = get(node[1])
        return np.isin(col, np.asarray(node[2], dtype=col.dtype if all(
            isinstance(v, int) for v in node[2]) else np.float64))
    _, op, lhs, rhs = node
    a = get(lhs[1]) if lhs[0] == "field" else lhs[1]
    b = get(rhs[1]) if rhs[0] == "field" else rhs[1]
    if lhs[0] == "num":  # keep the array on the left: numpy compares python ints exactly
        a, b, op = b, a, _FLIP[op]
    return _OPS[op](a, b)


def parse_predicate(text: str) -> Predicate:
    """Parse a ``--where`` predicate (see the module docstring for the grammar).

    Raises
    ------
    QueryError
        The text is malformed; ``position`` is the offending character's offset. Or it is
        longer than :data:`~tensorkv.viewer.limits.MAX_PREDICATE_CHARS` characters, or nests
        deeper than :data:`~tensorkv.viewer.limits.MAX_PREDICATE_DEPTH`.
    """
    if not isinstance(text, str):
        raise QueryError(f"predicate {shown(text)} must be a str such as 'freq >= 10'")
    return Predicate(text)
