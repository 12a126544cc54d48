"""Capture the architecture graph of a torch ``nn.Module``.

``torch.fx.symbolic_trace`` gives the true data flow (branches, merges, functions) where it
traces. A model fx cannot trace falls back to the module tree: with example inputs, its leaf
modules in the order a forward pass calls them (forward hooks); without, in registration
order. Both fallbacks describe a chain, since hooks do not see the data flow.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Literal

from tensorkv.checkpoint.objects import module_state
from tensorkv.errors import GraphError, import_optional
from tensorkv.repository.graph import Graph, Node, Param

Trace = Literal["auto", "fx", "hooks", "tree"]


def is_module(obj: Any) -> bool:
    """Whether ``obj`` is a torch ``nn.Module`` (without importing torch)."""
    return any(c.__module__ == "torch.nn.modules.module" and c.__name__ == "Module"
               for c in type(obj).__mro__)


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{mod}.{name}" if mod else str(name)


def _jsonable(x: Any) -> Any:
    """A JSON value standing for an fx argument (nodes become ``{"node": index}``)."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, slice):
        return {"slice": [_jsonable(x.start), _jsonable(x.stop), _jsonable(x.step)]}
    if type(x).__name__ == "Node" and hasattr(x, "op"):
        return "<input>"
    return str(x)


def _plain(x: Any) -> Any:
    """A JSON value standing for a module attribute, the same in every process.

    Numbers, strings and containers of them stand for themselves; tensors and arrays for
    their shape and dtype; functions and classes for their qualified name; any other object
    for the qualified name of its type (never its ``repr``, which may hold an address or
    changing state).
    """
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((_plain(v) for v in x), key=repr)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, enum.Enum):
        return f"{_qualname(type(x))}.{x.name}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return {"shape": [int(s) for s in x.shape], "dtype": str(x.dtype).replace("torch.", "")}
    if type(x).__module__ == "torch" and type(x).__name__ in ("dtype", "device", "layout"):
        return str(x)
    if isinstance(x, type) or (callable(x) and hasattr(x, "__qualname__")):
        return {"callable": _qualname(x)}
    return {"object": _qualname(type(x))}


def module_config(module: Any, children: bool) -> dict[str, Any]:
    """The configuration of a module: what its layer hash covers besides its params.

    ``attrs``: every public attribute of the module holding a value rather than a tensor it
    owns (torch modules keep their constructor arguments there: ``Dropout.p``,
    ``MultiheadAttention.num_heads``...), ``training`` excepted. With ``children``: the type
    and configuration of every submodule, recursively (a module traced as one node, such as
    ``nn.TransformerEncoderLayer``, is configured by its submodules too).
    """
    attrs = {k: _plain(v) for k, v in vars(module).items()
             if not k.startswith("_") and k != "training"}
    cfg: dict[str, Any] = {"attrs": attrs}
    if children:
        kids = {name: {"type": _qualname(type(m)), **module_config(m, True)}
                for name, m in module.named_children()}
        if kids:
            cfg["children"] = kids
    return cfg


def _own_params(module: Any, prefix: str, names: set[str],
                recurse: bool = False) -> tuple[Param, ...]:
    out = []
    items = (list(module.named_parameters(recurse=recurse))
             + list(module.named_buffers(recurse=recurse)))
    for local, t in items:
        full = f"{prefix}.{local}" if prefix else local
        if t is None or full not in names:
            continue
        out.append(Param(local, full, tuple(int(s) for s in t.shape),
                         str(t.dtype).replace("torch.", "")))
    return tuple(out)


def _module_node(name: str, target: str, module: Any, names: set[str],
                 inputs: tuple[str, ...], whole: bool = False) -> Node:
    """The node of ``module``; ``whole``: it stands for its submodules too (an fx leaf)."""
    return Node(name, "module", _qualname(type(module)), module_config(module, whole),
                _own_params(module, target, names, recurse=whole), inputs)


def _unique(want: str, taken: set[str]) -> str:
    """``want``, or ``want#2``, ``want#3``... (a module called more than once)."""
    name, k = want, 1
    while name in taken:
        k += 1
        name = f"{want}#{k}"
    taken.add(name)
    return name


def trace_fx(model: Any) -> Graph:
    """The graph of ``model`` from ``torch.fx.symbolic_trace`` (raises what fx raises).

    Module and attribute nodes are named by the module paths the user wrote
    (``encoder.layers.0.fc1``, not fx's ``encoder_layers_0_fc1`` or ``_0``); a module called
    twice gets ``#2`` on its second node. Other nodes keep fx's names (``relu``, ``add_1``).
    Names are labels: a node's layer hash never covers them.
    """
    fx = import_optional("torch.fx", "capturing a model graph", "torch")
    gm = fx.symbolic_trace(model)
    names = set(module_state(model))  # a dynamic module's rows are not exported for this
    nodes: list[Node] = []
    n_inputs = 0
    fx_nodes = list(gm.graph.nodes)
    # module paths first, so that another node whose fx name equals a path yields to it
    taken: set[str] = set()
    rename = {n.name: _unique(n.target, taken) for n in fx_nodes
              if n.op in ("call_module", "get_attr")}
    rename.update({n.name: _unique(n.name, taken) for n in fx_nodes if n.name not in rename})
    for n in fx_nodes:
        name = rename[n.name]
        inputs = tuple(rename[a.name] for a in n.all_input_nodes)
        if n.op == "placeholder":
            nodes.append(Node(name, "input", "input", {"index": n_inputs}))
            n_inputs += 1
        elif n.op == "call_module":
            nodes.append(_module_node(name, n.target, gm.get_submodule(n.target), names,
                                      inputs, whole=True))
        elif n.op == "get_attr":
            t = gm
            for part in n.target.split("."):
                t = getattr(t, part)
            params: tuple[Param, ...] = ()
            if n.target in names and hasattr(t, "shape"):
                params = (Param("", n.target, tuple(int(s) for s in t.shape),
                                str(t.dtype).replace("torch.", "")),)
            nodes.append(Node(name, "attr", "tensor", {}, params, inputs))
        else:
            target = n.target if isinstance(n.target, str) else _qualname(n.target)
            op = {"call_function": "function", "call_method": "method"}.get(n.op, n.op)
            cfg = {"args": _jsonable(n.args), "kwargs": _jsonable(dict(n.kwargs))}
            nodes.append(Node(name, op, target, cfg, (), inputs))
    return Graph(nodes)


def _leaves(model: Any) -> list[tuple[str, Any]]:
    """Modules that are leaves or own tensors, in registration order."""
    return [(name, m) for name, m in model.named_modules()
            if name and (not any(True for _ in m.children())
                         or any(True for _ in m.named_parameters(recurse=False)))]


def trace_hooks(model: Any, example_inputs: tuple[Any, ...]) -> Graph:
    """A chain of the leaf modules in the order a forward pass on ``example_inputs`` calls them."""
    torch = import_optional("torch", "capturing a model graph", "torch")
    order: list[str] = []
    handles = []
    for name, m in _leaves(model):
        handles.append(m.register_forward_hook(lambda _m, _i, _o, name=name: order.append(name)))
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return _chain(model, order)


def trace_tree(model: Any) -> Graph:
    """A chain of the leaf modules in registration order (no forward pass)."""
    return _chain(model, [name for name, _ in _leaves(model)])


def _chain(model: Any, order: list[str]) -> Graph:
    names = set(module_state(model))  # a dynamic module's rows are not exported for this
    mods = dict(model.named_modules())
    nodes = [Node("input", "input", "input", {"index": 0})]
    for i, name in enumerate(order):
        node_name = name if name not in {n.name for n in nodes} else f"{name}#{i}"
        nodes.append(_module_node(node_name, name, mods[name], names, (nodes[-1].name,)))
    return Graph(nodes)


def capture(model: Any, example_inputs: Any = None, *, trace: Trace = "auto") -> Graph:
    """The architecture graph of an ``nn.Module``.

    Parameters
    ----------
    model
        The module.
    example_inputs
        Inputs of one forward pass (a tensor or a tuple of them), used when fx cannot trace.
    trace
        ``"fx"`` (refuse models fx cannot trace), ``"hooks"`` (forward hooks; needs
        ``example_inputs``), ``"tree"`` (registration order), or ``"auto"``: fx, else hooks
        when ``example_inputs`` are given, else the tree.

    Raises
    ------
    GraphError
        ``trace="fx"`` on a model fx cannot trace, or ``"hooks"`` without inputs.
    """
    if not is_module(model):
        raise GraphError(f"capture() takes an nn.Module, got {type(model).__name__}")
    if trace not in ("auto", "fx", "hooks", "tree"):
        raise GraphError(f"trace={trace!r} is not one of 'auto', 'fx', 'hooks', 'tree'")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if trace in ("auto", "fx"):
        try:
            return trace_fx(model)
        except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...)
            if trace == "fx":
                raise GraphError(
                    f"torch.fx cannot trace {type(model).__name__}: {exc}; pass trace='hooks' "
                    "with example_inputs, or trace='tree'"
                ) from exc
    if trace == "hooks" or (trace == "auto" and example_inputs is not None):
        if example_inputs is None:
            raise GraphError("trace='hooks' needs example_inputs (one forward pass's inputs)")
        return trace_hooks(model, example_inputs)
    return trace_tree(model)
