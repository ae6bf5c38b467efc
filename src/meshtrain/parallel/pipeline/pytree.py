"""What crosses a stage boundary when it is more than one tensor: a pytree of tensors.

A stage may return one tensor (the common case, sent as before: ``p2p``'s 80-byte header
and the data) or any nesting of ``dict`` (string keys, in insertion order), ``tuple`` and
``list`` whose leaves are tensors: hidden states with their position ids, an attention
mask, an encoder-decoder's two streams. Such a tree is described once by its *spec*, an
int64 vector both ends can rebuild the tree from:

* a tensor leaf: ``[0, dtype code, needs grad, ndim, *shape]``;
* a dict: ``[1, n]`` then per item the key (``len, *code points``) and the value's spec;
* a tuple ``[2, n, ...]``, a list ``[3, n, ...]``, then the items' specs;
* ``None`` (an absent optional value, no tensor): ``[4]``.

A leaf *needs a gradient* when the sending stage's tensor requires one (in training: it
depends on the stage's parameters or input); only those leaves are received with
``requires_grad`` and only their gradients travel back, in the tree's leaf order. Leaves
that need none (position ids, a mask, any integer tensor) go forward only, unchanged:
integer leaves keep their dtype and values bit for bit.

Nothing here communicates; ``p2p`` sends the spec when it changes and the leaves every
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.errors import ConfigError

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
)
_LEAF, _DICT, _TUPLE, _LIST, _NONE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf of a decoded spec: what its receive buffer is allocated as."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


__all__ = [
    "DTYPES",
    "Leaf",
    "decode",
    "detach",
    "encode",
    "grad_leaves",
    "input_grads",
    "is_bare",
    "leaves",
    "needs_grad",
    "spec_leaves",
    "unflatten",
]


def is_bare(tree: Any) -> bool:
    """A single tensor: the boundary's original one-tensor format."""
    return isinstance(tree, torch.Tensor)


def leaves(tree: Any, where: str = "stage output") -> list[torch.Tensor]:
    """The tensors of ``tree`` in its order (dicts in insertion order); anything but a
    tensor, dict, tuple or list is a ConfigError naming its path."""
    out: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif node is None:
            return
        elif isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise ConfigError(
                        f"a pipeline {where} has the dict key {k!r} at {path or 'the top'}: "
                        "keys crossing a stage boundary must be strings"
                    )
                walk(v, f"{path}[{k!r}]")
        elif isinstance(node, (tuple, list)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        else:
            raise ConfigError(
                f"a pipeline {where} holds a {type(node).__name__} at {path or 'the top'}: "
                "a stage may return a tensor or a dict / tuple / list of tensors (and "
                "None); pass other values through the batch instead"
            )

    walk(tree, "")
    return out


def _dtype_code(t: torch.Tensor) -> int:
    if t.dtype not in DTYPES:
        raise ConfigError(
            f"a pipeline stage output of dtype {t.dtype} cannot be sent: use one of {DTYPES}"
        )
    return DTYPES.index(t.dtype)


def needs_grad(t: torch.Tensor) -> bool:
    """Whether a leaf's gradient travels back: it requires one (only floating tensors can)."""
    return bool(t.requires_grad)


def encode(tree: Any) -> tuple:
    """The spec of ``tree`` (see the module docstring), as a tuple of ints."""
    out: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            out.extend([_LEAF, _dtype_code(node), int(needs_grad(node)), node.dim(), *node.shape])
        elif node is None:
            out.append(_NONE)
        elif isinstance(node, dict):
            out.extend([_DICT, len(node)])
            for k, v in node.items():
                code = [ord(c) for c in k]
                out.extend([len(code), *code])
                walk(v)
        else:
            out.extend([_TUPLE if isinstance(node, tuple) else _LIST, len(node)])
            for v in node:
                walk(v)

    leaves(tree)  # refuses what cannot be sent, naming where
    walk(tree)
    return tuple(out)


def decode(spec: tuple) -> Any:
    """The tree ``spec`` describes, with a ``Leaf`` for each tensor."""
    pos = 0

    def take(n: int = 1) -> list[int]:
        nonlocal pos
        pos += n
        return list(spec[pos - n : pos])

    def walk() -> Any:
        (kind,) = take()
        if kind == _NONE:
            return None
        if kind == _LEAF:
            code, grad, ndim = take(3)
            return Leaf(tuple(take(ndim)), DTYPES[code], bool(grad))
        (n,) = take()
        if kind == _DICT:
            node = {}
            for _ in range(n):
                (length,) = take()
                key = "".join(chr(c) for c in take(length))
                node[key] = walk()
            return node
        items = [walk() for _ in range(n)]
        return tuple(items) if kind == _TUPLE else items

    return walk()


def unflatten(template: Any, values: list) -> Any:
    """``template``'s structure (a decoded spec, or a tree) with ``values`` as its leaves,
    in leaf order."""
    it = iter(values)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        if node is None:
            return None
        return next(it)

    return walk(template)


def spec_leaves(decoded: Any) -> list[Leaf]:
    """The ``Leaf`` entries of a decoded spec, in leaf order."""
    out: list[Leaf] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, Leaf):
            out.append(node)
        elif node is not None:
            for v in node:
                walk(v)

    walk(decoded)
    return out


def detach(tree: Any, train: bool) -> Any:
    """A stage's output handed to the next stage on the same rank: each leaf detached,
    requiring a gradient again (in training) where it needed one. A bare tensor keeps the
    one-tensor rule (``requires_grad_(train)``)."""
    if is_bare(tree):
        return tree.detach().requires_grad_(train)
    return unflatten(
        tree, [t.detach().requires_grad_(train and needs_grad(t)) for t in leaves(tree)]
    )


def grad_leaves(tree: Any) -> list[torch.Tensor]:
    """The leaves whose gradients travel back (a bare tensor: itself)."""
    if is_bare(tree):
        return [tree]
    return [t for t in leaves(tree) if needs_grad(t)]


def input_grads(tree: Any) -> Any:
    """What the receiving stage sends back for its input ``tree``: a bare tensor's
    ``.grad``; else the list of its gradient leaves' ``.grad`` (zeros for a leaf the stage
    did not use), in leaf order."""
    if is_bare(tree):
        return tree.grad
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in grad_leaves(tree)]
