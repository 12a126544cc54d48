"""The inputs and outputs of the embedding collections: jagged features and keyed tensors.

A collection is called once per step with every feature's ids. :func:`parse_features` accepts

* a ``KeyedJaggedTensor`` from TorchRec, or any object with its fields (duck typing, TorchRec
  is not needed): ``keys()`` (feature names), ``values()`` (the ids of every feature end to
  end, feature after feature), and ``lengths()`` (``[features * batch]`` ids per sample) or
  ``offsets()`` (``lengths``' running sum with a leading 0); ``weights_or_none()`` if it has
  per-sample weights;
* a dict ``{feature: ...}`` whose values are a 1-D tensor (one id per sample), a 2-D
  ``[batch, ids]`` tensor (bags of equal size), a tuple ``(ids, offsets)`` or
  ``(ids, offsets, per_sample_weights)`` as ``nn.EmbeddingBag`` takes them (``offsets``: the
  start of each bag), or a dict ``{"values": ids, "lengths": ...}`` (or ``"offsets"`` with
  the trailing end, as TorchRec's, and optionally ``"weights"``).

Every feature is checked (known name, integer ids, lengths that sum to the ids, one bag per
sample in every feature) before anything is looked up, so a bad input changes no table.
:class:`KeyedTensor` is the pooled output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorkv.errors import ConfigError, ShapeError


@dataclass
class Jagged:
    """One feature's ids of a batch: ``ids`` int64 ``[n]`` and where each sample's ids start.

    ``starts`` is int64 ``[batch]`` (as ``nn.EmbeddingBag``'s ``offsets``); ``weights`` the
    float per-sample weights ``[n]`` or None; ``shape`` the shape of an ids tensor given
    as it is (a 1-D or 2-D tensor; None for the jagged forms), so an unpooled lookup
    returns ``[*shape, dim]``.
    """

    ids: torch.Tensor
    starts: torch.Tensor
    weights: torch.Tensor | None
    shape: tuple[int, ...] | None

    @property
    def batch(self) -> int:
        """Samples (bags) of the feature."""
        return int(self.starts.shape[0])

    @property
    def n(self) -> int:
        """Ids of the feature."""
        return int(self.ids.shape[0])


def _ids(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"feature {name!r}: ids must be an int64 (or int32) torch tensor; got "
                         f"{type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"feature {name!r}: ids have dtype {x.dtype}; pass int64 (or int32) "
                         "ids (cast with ids.long())")
    return x.detach().to("cpu", torch.int64)


def _weights(name: str, w: Any, n: int) -> torch.Tensor | None:
    if w is None:
        return None
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or tuple(w.shape) != (n,):
        raise ShapeError(f"feature {name!r}: per-sample weights must be a float tensor of shape "
                         f"({n},), one per id; got {getattr(w, 'dtype', type(w).__name__)} "
                         f"{tuple(getattr(w, 'shape', ()))}")
    return w.to(torch.float32)


def _starts_from_lengths(name: str, lengths: Any, n: int) -> torch.Tensor:
    ln = torch.as_tensor(lengths)
    if ln.dim() != 1 or ln.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"feature {name!r}: lengths must be a 1-D integer tensor; got "
                         f"{ln.dtype} {tuple(ln.shape)}")
    ln = ln.to("cpu", torch.int64)
    if ln.numel() and int(ln.min()) < 0:
        raise ShapeError(f"feature {name!r}: lengths hold a negative count "
                         f"({int(ln.min())}); each sample has zero or more ids")
    total = int(ln.sum())
    if total != n:
        raise ShapeError(f"feature {name!r}: lengths sum to {total} but the feature has {n} "
                         "ids; the lengths must sum to the number of ids")
    starts = torch.zeros_like(ln)
    if ln.numel() > 1:
        torch.cumsum(ln[:-1], 0, out=starts[1:])
    return starts


def check_offsets(name: str, offsets: Any, n: int, with_end: bool) -> torch.Tensor:
    """``offsets`` of ``n`` ids checked (1-D ints from 0, not decreasing, within the ids).

    ``with_end``: the last entry is the end of the last bag (TorchRec's), dropped from the
    result. Returns the start of each bag as int64.
    """
    off = torch.as_tensor(offsets)
    if off.dim() != 1 or off.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"feature {name!r}: offsets must be a 1-D integer tensor; got "
                         f"{off.dtype} {tuple(off.shape)}")
    off = off.to("cpu", torch.int64)
    if with_end:
        if off.numel() == 0 or int(off[-1]) != n:
            raise ShapeError(f"feature {name!r}: offsets (with the end, as TorchRec's) must end "
                             f"at the number of ids, {n}; got {off[-3:].tolist()}")
        off = off[:-1]
    if off.numel():
        if int(off[0]) != 0:
            raise ShapeError(f"feature {name!r}: offsets must start at 0 (the first bag starts "
                             f"at the first id); got {int(off[0])}")
        if bool((off[1:] < off[:-1]).any()) or int(off[-1]) > n:
            raise ShapeError(f"feature {name!r}: offsets must not decrease and must stay within "
                             f"the {n} ids; got {off.tolist()[:8]}")
    elif n:
        raise ShapeError(f"feature {name!r}: {n} ids but no bags (empty offsets)")
    return off


def _one(name: str, x: Any) -> Jagged:
    """A feature's value in one of the dict forms (see the module docstring)."""
    if isinstance(x, torch.Tensor):
        ids = _ids(name, x)
        if ids.dim() == 1:
            return Jagged(ids, torch.arange(ids.shape[0]), None, tuple(x.shape))
        if ids.dim() == 2:
            b, m = ids.shape
            return Jagged(ids.reshape(-1), torch.arange(0, b * m, m) if m else
                          torch.zeros(b, dtype=torch.int64), None, tuple(x.shape))
        raise ShapeError(f"feature {name!r}: an ids tensor of shape {tuple(x.shape)}; give a "
                         "1-D tensor (one id per sample), a 2-D [batch, ids] tensor, or "
                         "(ids, offsets)")
    if isinstance(x, Mapping):
        unknown = sorted(set(x) - {"values", "ids", "lengths", "offsets", "weights"})
        if unknown or ("values" in x) == ("ids" in x) or ("lengths" in x) == ("offsets" in x):
            raise ShapeError(f"feature {name!r}: a dict needs 'values' (or 'ids') and either "
                             f"'lengths' or 'offsets' (and optionally 'weights'); got "
                             f"{sorted(x)}")
        ids = _ids(name, x["values"] if "values" in x else x["ids"])
        if ids.dim() != 1:
            raise ShapeError(f"feature {name!r}: jagged values must be 1-D; got "
                             f"{tuple(ids.shape)}")
        n = ids.shape[0]
        starts = (_starts_from_lengths(name, x["lengths"], n) if "lengths" in x
                  else check_offsets(name, x["offsets"], n, with_end=True))
        return Jagged(ids, starts, _weights(name, x.get("weights"), n), None)
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        ids = _ids(name, x[0])
        if ids.dim() != 1:
            raise ShapeError(f"feature {name!r}: (ids, offsets) needs 1-D ids; got "
                             f"{tuple(ids.shape)}")
        n = ids.shape[0]
        starts = check_offsets(name, x[1], n, with_end=False)
        return Jagged(ids, starts, _weights(name, x[2] if len(x) == 3 else None, n), None)
    raise ShapeError(f"feature {name!r}: {type(x).__name__} is not a feature input; give an ids "
                     "tensor, (ids, offsets[, per_sample_weights]) or {'values': ids, "
                     "'lengths': lengths}")


def _call(obj: Any, name: str) -> Any:
    attr = getattr(obj, name, None)
    return attr() if callable(attr) else attr


def is_keyed_jagged(x: Any) -> bool:
    """Whether ``x`` has the fields of TorchRec's ``KeyedJaggedTensor``."""
    return (not isinstance(x, Mapping) and hasattr(x, "keys") and hasattr(x, "values")
            and (hasattr(x, "lengths") or hasattr(x, "offsets")))


def _from_keyed_jagged(kjt: Any) -> dict[str, Jagged]:
    names = [str(k) for k in _call(kjt, "keys")]
    values = _ids("values()", _call(kjt, "values"))
    if values.dim() != 1:
        raise ShapeError(f"KeyedJaggedTensor values() must be 1-D; got {tuple(values.shape)}")
    n = values.shape[0]
    lengths = _call(kjt, "lengths_or_none") if hasattr(kjt, "lengths_or_none") else (
        _call(kjt, "lengths") if hasattr(kjt, "lengths") else None)
    if lengths is None:
        offsets = _call(kjt, "offsets_or_none") if hasattr(kjt, "offsets_or_none") else (
            _call(kjt, "offsets"))
        if offsets is None:
            raise ShapeError("the KeyedJaggedTensor has neither lengths nor offsets")
        starts = check_offsets("<all>", offsets, n, with_end=True)
        ends = torch.cat([starts[1:], torch.tensor([n])])
        lengths = ends - starts
    lengths = torch.as_tensor(lengths).to("cpu", torch.int64)
    if not names:
        if n:
            raise ShapeError(f"a KeyedJaggedTensor without keys holds {n} values")
        return {}
    if lengths.dim() != 1 or lengths.shape[0] % len(names):
        raise ShapeError(f"KeyedJaggedTensor lengths of shape {tuple(lengths.shape)} do not "
                         f"split into {len(names)} features of one batch; lengths must hold "
                         "features * batch entries")
    weights = _call(kjt, "weights_or_none") if hasattr(kjt, "weights_or_none") else None
    _starts_from_lengths("<all>", lengths, n)  # checks the sum and signs
    b = lengths.shape[0] // len(names)
    per_key = lengths.reshape(len(names), b).sum(1).tolist()
    out: dict[str, Jagged] = {}
    lo = 0
    for f, name in enumerate(names):
        hi = lo + int(per_key[f])
        w = None if weights is None else _weights(name, weights[lo:hi], hi - lo)
        if name in out:
            raise ShapeError(f"the KeyedJaggedTensor names feature {name!r} twice")
        out[name] = Jagged(values[lo:hi], _starts_from_lengths(
            name, lengths[f * b:(f + 1) * b], hi - lo), w, None)
        lo = hi
    return out


def parse_features(features: Any, known: Sequence[str]) -> dict[str, Jagged]:
    """Every feature of ``features`` as a :class:`Jagged`, checked (see the module docstring).

    Raises
    ------
    ShapeError
        For a malformed feature (named), or features with different batch sizes.
    ConfigError
        For a feature the collection does not know, or one of its features missing.
    """
    if is_keyed_jagged(features):
        parsed = _from_keyed_jagged(features)
    elif isinstance(features, Mapping):
        parsed = {str(k): _one(str(k), v) for k, v in features.items()}
    else:
        raise ShapeError(f"features of type {type(features).__name__}: pass a dict "
                         "{feature: ids or (ids, offsets)} or a KeyedJaggedTensor")
    unknown = sorted(set(parsed) - set(known))
    if unknown:
        raise ConfigError(f"features {unknown} are not features of this collection; its "
                          f"features are {list(known)}")
    missing = [k for k in known if k not in parsed]
    if missing:
        raise ConfigError(f"features {missing} are missing from the input; pass every feature "
                          "of the collection (a feature without ids: empty bags)")
    sizes = {k: parsed[k].batch for k in known}
    if len(set(sizes.values())) > 1:
        raise ShapeError(f"the features have different batch sizes {sizes}; every feature "
                         "needs one bag (one entry of lengths/offsets) per sample")
    return {k: parsed[k] for k in known}


class KeyedTensor:
    """Pooled features side by side, as TorchRec's ``KeyedTensor``.

    ``values()`` is ``[batch, sum(dims)]`` (features in the collection's order),
    ``to_dict()`` maps each feature to its ``[batch, dim]`` tensor, ``kt[name]`` is one of
    them; ``keys()``, ``length_per_key()`` and ``offset_per_key()`` describe the columns.
    """

    def __init__(self, keys: list[str],
                 tensors: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]],
                 values: Callable[[], torch.Tensor] | None = None,
                 widths: list[int] | None = None) -> None:
        self._keys = list(keys)
        self._given = tensors  # a dict, or what makes it (when first asked for)
        self._made: dict[str, torch.Tensor] | None = tensors if isinstance(tensors, dict) \
            else None
        self._make_values = values
        self._values: torch.Tensor | None = None
        self._widths = widths

    @property
    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._made is None:
            assert callable(self._given)
            self._made = self._given()
        return self._made

    def keys(self) -> list[str]:
        """Feature names, in column order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """The pooled features concatenated: ``[batch, sum(dims)]``."""
        if self._values is None:
            self._values = (self._make_values() if self._make_values is not None else
                            torch.cat([self._tensors[k] for k in self._keys], 1))
        return self._values

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Each feature's ``[batch, dim]`` tensor."""
        return dict(self._tensors)

    def length_per_key(self) -> list[int]:
        """Each feature's width (its dim)."""
        if self._widths is not None:
            return list(self._widths)
        return [int(self._tensors[k].shape[1]) for k in self._keys]

    def offset_per_key(self) -> list[int]:
        """Column where each feature starts, and the total width last."""
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, widths={self.length_per_key()})"


__all__ = ["Jagged", "KeyedTensor", "check_offsets", "is_keyed_jagged", "parse_features"]
