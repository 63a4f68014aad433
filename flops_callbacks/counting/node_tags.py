"""The tags the counting engine puts on autograd nodes: which module and functional made each node, so
that the backward's ops are attributed where their forward ran.

A tag is a key in ``Node.metadata``, set right after the call that created the node and removed by
:meth:`NodeTags.clear` when the trace stops. Why weak references to the tagged tensors and not the
nodes: holding a node holds what it saves, and under activation checkpointing that is every recomputed
activation, which autograd frees as soon as the backward has read it (a node's Python object takes no
weak reference). The walk from the tensors still alive finds every tagged node still alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils._pytree import tree_leaves

from flops_callbacks.counting.recording import Site

__all__ = ["NodeTags", "TAG"]

TAG = "flops_callbacks.context"  # key in autograd Node.metadata, removed on stop()


class NodeTags:
    """Tags the nodes of the tensors a call returns, and removes every tag still on a live node."""

    def __init__(self) -> None:
        self._tagged: list[weakref.ref[torch.Tensor]] = []  # the tensors whose nodes were tagged
        # the parameters' gradient accumulators that were tagged: they outlive the graph (DDP's reducer
        # holds them), save no activation, and are untagged at the end by name, not by a walk
        self._accumulators: list[Any] = []

    def tag(self, out: Any, ctx: Site, watch: Callable[[Any, Site], None] | None) -> None:
        """Tag the nodes that made ``out`` (a tensor or a structure of them), and every node above them
        not tagged yet, with ``ctx``; ``watch(node, ctx)`` reads each newly tagged node (the forward's
        saved tensors).

        Args:
            out: a call's output: a tensor or a structure of them.
            ctx: where the nodes' work goes.
            watch: what reads each newly tagged node, or None.
        """
        if isinstance(out, torch.Tensor):
            tensors = [out]
        else:
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for tensor in tensors:
            node = tensor.grad_fn
            if node is None or TAG in cast(dict[str, Any], node.metadata):
                continue
            self._tagged.append(weakref.ref(tensor))
            pending = [node]
            while pending:
                node = pending.pop()
                metadata = cast(dict[str, Any], node.metadata)  # a dict (torch's stubs say a method)
                if TAG in metadata:
                    continue
                metadata[TAG] = ctx
                if not node.next_functions and node.name().endswith("AccumulateGrad"):
                    self._accumulators.append(node)
                if watch is not None:
                    watch(node, ctx)
                pending.extend(n for n, _ in node.next_functions if n is not None)

    def clear(self) -> None:
        """Remove the tag from every tagged node still alive: each is reachable from a tagged tensor
        still alive, since every node above a tagged one was tagged with it or before it."""
        tensors = [t for ref in self._tagged if (t := ref()) is not None]
        self._tagged = []
        pending = [t.grad_fn for t in tensors if t.grad_fn is not None] + self._accumulators
        self._accumulators = []
        seen: set[Any] = set()  # holds each node's Python object during the walk: identity is stable
        while pending:
            node = pending.pop()
            if node in seen:
                continue
            seen.add(node)
            cast(dict[str, Any], node.metadata).pop(TAG, None)
            pending.extend(n for n, _ in node.next_functions if n is not None)
