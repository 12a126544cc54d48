"""Architecture graphs: a framework-free description, validation and stable layer hashes.

A graph is a list of nodes in topological order; each node names its inputs (the edges).
A node's *layer hash* covers its own signature (op, type, configuration, and the local names,
shapes and dtypes of its parameters, never its name) and the hashes of its inputs in order,
so a hash identifies the node together with its whole ancestry (a Merkle DAG). The format and
the hash are specified in docs/repository.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tensorkv.errors import GraphError

#: Version tag of the graph description format.
GRAPH_FORMAT = "tensorkv.graph/1"
#: Domain separator of layer hashes (changing it changes every hash).
_HASH_DOMAIN = b"tensorkv-layer/1\x00"
#: The canonical JSON of signatures (one encoder: building one per call costs more).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Param:
    """A tensor a node owns: its local name in the node, its state-dict name, shape and dtype."""

    local: str
    tensor: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Node:
    """One layer or operation of a graph."""

    name: str
    op: str
    type: str
    config: Mapping[str, Any] = field(default_factory=dict)
    params: tuple[Param, ...] = ()
    inputs: tuple[str, ...] = ()

    def signature(self) -> bytes:
        """Canonical bytes of what the node is, without its name or its inputs."""
        params = sorted((p.local, list(p.shape), p.dtype) for p in self.params)
        doc = {"op": self.op, "type": self.type, "config": self.config, "params": params}
        try:
            return _CANONICAL.encode(doc).encode()
        except (TypeError, ValueError) as exc:
            raise GraphError(f"node {self.name!r}: 'config' is not JSON-serialisable: "
                             f"{exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The node in the JSON graph format."""
        return {
            "name": self.name,
            "op": self.op,
            "type": self.type,
            "config": dict(self.config),
            "params": {p.local: {"tensor": p.tensor, "shape": list(p.shape), "dtype": p.dtype}
                       for p in self.params},
            "inputs": list(self.inputs),
        }


class Graph:
    """A model's architecture: nodes in topological order, each naming its inputs.

    Parameters
    ----------
    nodes
        The nodes; every input must name an earlier node.

    Raises
    ------
    GraphError
        A duplicate node name, an input naming no earlier node, or a bad field.
    """

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.index: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            if n.name in self.index:
                raise GraphError(f"node name {n.name!r} appears twice; node names must be unique")
            for src in n.inputs:
                if src not in self.index:
                    raise GraphError(
                        f"node {n.name!r} takes input {src!r}, which is not an earlier node; "
                        "list the nodes in topological order (inputs first)"
                    )
            self.index[n.name] = i
        self._hashes: list[bytes] | None = None
        self.hashes()  # validates every configuration too

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<Graph of {len(self.nodes)} nodes>"

    # ----------------------------------------------------------------- format
    def to_dict(self) -> dict[str, Any]:
        """The graph as a JSON-ready dict (the documented format)."""
        return {"format": GRAPH_FORMAT, "nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Graph:
        """Build a graph from the documented dict format (validating every field)."""
        if not isinstance(doc, Mapping) or "nodes" not in doc:
            raise GraphError(
                f"a graph description is a dict with a 'nodes' list, got {type(doc).__name__}"
                f"{' without nodes' if isinstance(doc, Mapping) else ''}; see docs/repository.md"
            )
        fmt = doc.get("format", GRAPH_FORMAT)
        if fmt != GRAPH_FORMAT:
            raise GraphError(f"graph format {fmt!r} is not {GRAPH_FORMAT!r}; upgrade tensorkv")
        raw = doc["nodes"]
        if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
            raise GraphError(f"'nodes' must be a list of node dicts, got {type(raw).__name__}")
        return cls([_node_from_dict(i, d) for i, d in enumerate(raw)])

    # ----------------------------------------------------------------- hashes
    def hashes(self) -> list[bytes]:
        """The 16-byte layer hash of each node (Merkle over the DAG), in node order.

        Nodes with the same signature and the same inputs (two identical branches on one
        input) are told apart by their occurrence number in node order.
        """
        if self._hashes is None:
            out: list[bytes] = []
            seen: dict[bytes, int] = {}
            for n in self.nodes:
                h = xxhash.xxh3_128()
                h.update(_HASH_DOMAIN)
                sig = n.signature()
                h.update(len(sig).to_bytes(8, "little"))
                h.update(sig)
                for src in n.inputs:
                    h.update(out[self.index[src]])
                base = h.digest()
                occ = seen.get(base, 0)
                seen[base] = occ + 1
                out.append(base if occ == 0 else xxhash.xxh3_128_digest(
                    base + occ.to_bytes(4, "little")))
            self._hashes = out
        return self._hashes

    def hash_keys(self) -> np.ndarray:
        """The layer hashes folded to uint64 (the prefix index's keys), in node order."""
        return np.frombuffer(b"".join(h[:8] for h in self.hashes()), dtype="<u8").copy()

    def predecessors(self) -> list[list[int]]:
        """Indices of each node's inputs."""
        return [[self.index[s] for s in n.inputs] for n in self.nodes]

    def tensor_names(self) -> list[str]:
        """The state-dict names of every node's parameters, in node order."""
        return [p.tensor for n in self.nodes for p in n.params]


def _node_from_dict(i: int, d: Any) -> Node:
    if type(d) is not dict and not isinstance(d, Mapping):
        raise GraphError(f"node {i} is a {type(d).__name__}; each node is a dict")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise GraphError(f"node {i} has no 'name' (a non-empty str), got {name!r}")
    op, typ = d.get("op", "module"), d.get("type")
    if not isinstance(op, str) or not isinstance(typ, str) or not typ:
        raise GraphError(f"node {name!r}: 'op' and 'type' must be non-empty strings")
    config = d.get("config", {})
    if type(config) is not dict and not isinstance(config, Mapping):
        raise GraphError(f"node {name!r}: 'config' must be a dict, got {type(config).__name__}")
    params = []
    raw_params = d.get("params", {})
    if type(raw_params) is not dict and not isinstance(raw_params, Mapping):
        raise GraphError(f"node {name!r}: 'params' must be a dict of local name -> tensor info")
    for local, info in raw_params.items():
        if not isinstance(info, Mapping) or "shape" not in info or "dtype" not in info:
            raise GraphError(
                f"node {name!r}: param {local!r} needs 'shape' and 'dtype' (and 'tensor', its "
                f"state-dict name), got {info!r}"
            )
        tensor = info.get("tensor") or (f"{name}.{local}" if local else name)
        params.append(Param(str(local), str(tensor), tuple(int(s) for s in info["shape"]),
                            str(info["dtype"])))
    inputs = d.get("inputs", [])
    if type(inputs) is not list and (isinstance(inputs, str) or not isinstance(inputs, Sequence)):
        raise GraphError(f"node {name!r}: 'inputs' must be a list of node names")
    return Node(name, op, typ, dict(config), tuple(params), tuple(str(s) for s in inputs))


def as_graph(obj: Any) -> Graph:
    """Return ``obj`` as a :class:`Graph` (a Graph, or a dict in the documented format)."""
    if isinstance(obj, Graph):
        return obj
    if isinstance(obj, Mapping):
        return Graph.from_dict(obj)
    raise GraphError(
        f"expected a Graph, a graph dict or an nn.Module, got {type(obj).__name__}; "
        "see docs/repository.md for the graph format"
    )
