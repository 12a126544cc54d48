"""Capture the architecture graph of a torch ``nn.Module``.

``torch.fx.symbolic_trace`` gives the true data flow (branches, merges, functions) where it
traces. A model fx cannot trace falls back to the module tree: with example inputs, its leaf
modules in the order a forward pass calls them (forward hooks); without, in registration
order. Both fallbacks describe a chain, since hooks do not see the data flow.
"""

from __future__ import annotations

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


def _own_params(module: Any, prefix: str, names: set[str]) -> tuple[Param, ...]:
    out = []
    items = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    for local, t in items:
        full = f"{prefix}.{local}" if prefix else local
        if t is None or full not in names:
            continue
        out.append(Param(local, full, tuple(int(s) for s in t.shape),
                         str(t.dtype).replace("torch.", "")))
    return tuple(out)


def _module_node(name: str, target: str, module: Any, names: set[str],
                 inputs: tuple[str, ...]) -> Node:
    return Node(name, "module", _qualname(type(module)), {"repr": module.extra_repr()},
                _own_params(module, target, names), inputs)


def trace_fx(model: Any) -> Graph:
    """The graph of ``model`` from ``torch.fx.symbolic_trace`` (raises what fx raises)."""
    fx = import_optional("torch.fx", "capturing a model graph", "torch")
    gm = fx.symbolic_trace(model)
    names = set(module_state(model))  # a dynamic module's rows are not exported for this
    nodes: list[Node] = []
    n_inputs = 0
    for n in gm.graph.nodes:
        inputs = tuple(a.name for a in n.all_input_nodes)
        if n.op == "placeholder":
            nodes.append(Node(n.name, "input", "input", {"index": n_inputs}))
            n_inputs += 1
        elif n.op == "call_module":
            nodes.append(_module_node(n.name, n.target, gm.get_submodule(n.target), names,
                                      inputs))
        elif n.op == "get_attr":
            t = gm
            for part in n.target.split("."):
                t = getattr(t, part)
            params: tuple[Param, ...] = ()
            if n.target in names and hasattr(t, "shape"):
                params = (Param("", n.target, tuple(int(s) for s in t.shape),
                                str(t.dtype).replace("torch.", "")),)
            nodes.append(Node(n.name, "attr", "tensor", {}, params, inputs))
        else:
            target = n.target if isinstance(n.target, str) else _qualname(n.target)
            op = {"call_function": "function", "call_method": "method"}.get(n.op, n.op)
            cfg = {"args": _jsonable(n.args), "kwargs": _jsonable(dict(n.kwargs))}
            nodes.append(Node(n.name, op, target, cfg, (), inputs))
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
