"""The model repository: many model variants stored once, sharing their unchanged tensors.

:class:`Repository` stores models (torch modules or framework-free graph descriptions with
their tensors), reads whole models, single tensors or slices, answers longest-common-prefix
queries over architecture graphs, and transfers shared layers. ``repo`` holds the
repository, ``write`` its put writer, ``maintenance`` gc/check/stats/rebalance (both work on
:class:`~tensorkv.repository.core.RepositoryCore`, the part of a repository they use),
``index``, ``refs``, ``tensors`` and ``layout`` the records in the stores, ``capture`` and
``graph`` architecture graphs. See docs/repository.md.
"""

from __future__ import annotations

from tensorkv.repository.capture import capture
from tensorkv.repository.graph import GRAPH_FORMAT, Graph, Node, Param, as_graph
from tensorkv.repository.repo import Repository

__all__ = ["GRAPH_FORMAT", "Graph", "Node", "Param", "Repository", "as_graph", "capture"]
