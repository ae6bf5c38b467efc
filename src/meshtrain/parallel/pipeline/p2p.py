"""One step's point-to-point traffic between stages, with every receive posted early.

What is communicated, per micro-batch and stage boundary, over the ``pp`` group:

* forward: a 10-element int64 header ``[ndim, dtype code, *shape]`` (80 bytes) and the
  activation (``b * t * d`` elements for a transformer); the header is why micro-batches
  of different shapes (sequence lengths, evaluation batch sizes) need nothing cached;
* backward: the activation's gradient, the shape of the activation the receiver sent
  (the receiver allocates it from its own output, so no header).

A stage may instead return a pytree of tensors (dict / tuple / list, nested: ``pytree``).
Then, per micro-batch and boundary:

* forward: the same 80-byte header, ``[-1, L, changed, 0...]``; when ``changed`` (the
  channel's first tree, or one whose shapes, dtypes, structure or gradient flags differ
  from the previous message's, e.g. a new sequence length) the tree's spec follows, ``L``
  int64 (``8 L`` bytes); then every leaf, in leaf order, at its own dtype (integer leaves
  as they are);
* backward: the gradients of the leaves that need one (``pytree.needs_grad``), in leaf
  order; a leaf that needs none (position ids, a mask) costs nothing backward.

So the shapes and dtypes are agreed once per channel and again when they change, and
``sum over leaves`` of their bytes replaces the one activation's.

Channels: a message goes with tag ``4 s + k``, ``s`` the *receiving* stage, ``k`` 0 for a
header, 1 for an activation (every leaf of a tree, in order), 2 for a gradient, 3 for a
tree's spec. Between two ranks the messages of one tag
match in the order they are posted, and on one channel both sides go in micro-batch
order, so a receive can be posted long before the schedule reaches it without taking
another message's data (with one tag for everything, a header posted ahead would match
the previous activation).

Why early: a gloo message moves once both its send and its receive are posted, so a
receive posted when the rank reaches it puts a round trip on the critical path of every
stage crossing, and the header made it two (header, then the activation's receive). Here:

* every header receive of the step is posted when the step starts (80 bytes each);
* an activation's receive is posted before its header comes when its shape can be
  guessed (below), else as soon as its header is in (checked between computes), so the
  data flows while the rank computes;
* a gradient's receive is posted one compute ahead: when the compute before it in the
  action list starts (its buffer is the output's shape, known once the forward ran), so
  it costs one gradient buffer alive one compute early.

Guessed activation receives: a receive posted on its header leaves two more one-way
trips on the path (the receive's "ready" notice to the sender, then the data) than one
posted before the send. So when a channel's last two activations had the same shape and
dtype, the receiver posts the next one's receive with that shape at once (at step start
for a step's first micro-batch, else as soon as the previous header is read). Both ends
know the rule: ``ShapeMemory`` holds the last two shapes of every channel on each, updated
per message in the one order both follow. The header still travels every time and
decides:

* it matches the guess: the guessed receive is the activation's (the common case, every
  micro-batch the same shape);
* it does not: the sender, knowing the receiver guessed, first sends a dummy of the
  guessed shape, which fills the guessed receive (its buffer is dropped), and the
  activation goes to a receive posted on the header, as without a guess.

So a shape change after a run of equal shapes costs one dummy message, shapes that vary
every micro-batch never guess (no two in a row are equal) and cost what they did, and
nothing is cached wrongly: every buffer is checked against its header.

A receive is *waited on* by the compute that consumes it (``activation(stage, mb)``
before a forward, ``gradient(stage, mb)`` before the backward that needs it), not at its
place in the action list. The list places a receive before the first compute starting at
or after the data's simulated arrival, so with a tie (arrival == start, common with equal
stage costs) it stands before a compute that does not need it, and waiting there couples
the ranks: any lateness of the sender stalls the receiver (measured: 6-11 ms per such
wait at 100 ms units, the bulk of interleaved 1F1B's excess bubble at p 2, see
docs/pipeline.md). The list still gives the order receives are *posted* in, per kind
(looped placement: all of a rank's activations come from one peer, all its gradients
from the other, sent in that order; in the V of zbv / dualpipev a rank gets each kind
from both neighbours, one channel per receiving stage, and posting in list order still
only waits on data sent earlier in simulated time), and a compute only waits for its own input, sent by a compute that
precedes it in simulated time: the schedule's argument that the step cannot deadlock
(``schedules``) holds unchanged. Sends are non-blocking; the step waits on them at its
end, which also keeps the sent tensors alive until then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshtrain.distributed import comm
from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline import pytree
from meshtrain.parallel.pipeline.schedules import COMPUTE, RECV_B, RECV_F, Action

_DTYPES = pytree.DTYPES
_MAX_DIMS = 8
HEADER, ACTIVATION, GRADIENT, SPEC = 0, 1, 2, 3
TREE = -1  # header[0] of a pytree message (a bare tensor's is its ndim, >= 0)


def header_of(t: torch.Tensor) -> torch.Tensor:
    """``[ndim, dtype code, *shape, 0...]`` (``2 + _MAX_DIMS`` int64) describing ``t``."""
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ConfigError(
            f"a pipeline stage output of shape {tuple(t.shape)} and dtype {t.dtype} cannot be "
            f"sent: stages must return tensors of at most {_MAX_DIMS} dims in {_DTYPES}"
        )
    pad = [0] * (_MAX_DIMS - t.dim())
    return torch.tensor([t.dim(), _DTYPES.index(t.dtype), *t.shape, *pad], dtype=torch.int64)


def tree_header(spec_len: int, changed: bool) -> torch.Tensor:
    """``[-1, L, changed, 0...]``: a pytree follows, its spec (``L`` int64) with it if
    ``changed``, else the channel's previous spec holds."""
    return torch.tensor([TREE, spec_len, int(changed)] + [0] * (_MAX_DIMS - 1), dtype=torch.int64)


def _tag(stage: int, kind: int) -> int:
    return 4 * stage + kind


def _shape_of(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    ndim = int(header[0])
    return tuple(header[2 : 2 + ndim].tolist()), _DTYPES[int(header[1])]


def key_of(value) -> tuple:
    """What ``ShapeMemory`` records for a message: ``(shape, dtype)`` of a bare tensor,
    ``("tree", spec)`` of a pytree."""
    if pytree.is_bare(value):
        return (tuple(value.shape), value.dtype)
    return ("tree", pytree.encode(value))


def _buffers(key: tuple, device) -> list[torch.Tensor]:
    """Receive buffers of a message recorded as ``key``, in send order."""
    if key[0] != "tree":
        return [torch.empty(key[0], dtype=key[1], device=device)]
    return [
        torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        for leaf in pytree.spec_leaves(pytree.decode(key[1]))
    ]


def _value(key: tuple, bufs: list[torch.Tensor]):
    """The received message: the tensor, or the tree rebuilt from its leaves."""
    if key[0] != "tree":
        return bufs[0]
    return pytree.unflatten(pytree.decode(key[1]), bufs)


class ShapeMemory:
    """The last two ``(shape, dtype)`` sent over each activation channel (keyed by the
    receiving stage), kept alike on its sender and its receiver: both record every
    message in channel order, so both know whether the receiver guessed."""

    def __init__(self) -> None:
        self._last: dict[int, tuple] = {}
        # this rank's receives posted on a guess that its header confirmed / refuted, and
        # the dummies it sent for a guess it refuted (what the tests count exactly)
        self.hits = self.misses = self.dummies = 0

    def guess(self, stage: int) -> tuple | None:
        """The shape the receiver of ``stage``'s channel posts its next receive with before
        the header comes, or None (the last two messages differed, or fewer than two)."""
        prev, last = self._last.get(stage, (None, None))
        return last if last is not None and prev == last else None

    def record(self, stage: int, shape: tuple) -> None:
        self._last[stage] = (self._last.get(stage, (None, None))[1], shape)

    def last(self, stage: int) -> tuple | None:
        """The last message recorded on ``stage``'s channel (a tree header without a spec
        means this one's spec again)."""
        return self._last.get(stage, (None, None))[1]


class StepLinks:
    """The sends and receives of one rank's action list for one step.

    ``outputs``: the runtime's ``{(stage, mb): output}`` (read for the gradient buffers'
    shapes); ``shapes``: the runtime's ``ShapeMemory``, which outlives the step. Call
    ``post_ahead(i)`` before running the compute action at index ``i``;
    ``activation(stage, mb)`` / ``gradient(stage, mb)`` return a received tensor (and
    wait for it) when the compute that consumes it is about to run; ``finish()`` at the
    end of the step.
    """

    def __init__(
        self,
        group: comm.Group,
        actions: Sequence[Action],
        outputs: dict,
        device: torch.device,
        shapes: ShapeMemory,
        rank_of=None,
    ) -> None:
        self.group, self.p, self.device, self.outputs = group, group.size, device, outputs
        # the pp rank of a stage: ``stage % p`` unless the schedule places them in a V
        self.rank_of = rank_of or (lambda stage: stage % self.p)
        self.shapes = shapes
        self.actions = actions
        self.sends: list = []
        n = len(actions)
        # next_compute[i]: index of the first compute action after i (n if none)
        self.next_compute = [n] * n
        nxt = n
        for i in range(n - 1, -1, -1):
            self.next_compute[i] = nxt
            if actions[i].kind in COMPUTE:
                nxt = i
        self.recv_f = [i for i, a in enumerate(actions) if a.kind == RECV_F]
        self.recv_b = [i for i, a in enumerate(actions) if a.kind == RECV_B]
        self.index = {(a.kind, a.stage, a.mb): i for i, a in enumerate(actions)}
        self.f_next = self.b_next = 0  # the next receive of each list to post
        self.posted: dict[int, tuple] = {}  # action index -> (tensor or tree, works)
        self.headers: dict[int, tuple[torch.Tensor, list]] = {}
        self.guessed: dict[int, tuple] = {}  # receives posted on a guess: (key, bufs, works)
        self.dummies: list[tuple] = []  # guesses dummies will fill: (bufs, works)
        self.specs: dict[tuple[int, int], object] = {}  # (stage, mb) -> a tree's decoded spec
        self.next_on_channel: dict[int, int] = {}  # RECV_F index -> the channel's next one
        first: dict[int, int] = {}
        for i in self.recv_f:
            a = actions[i]
            h = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
            self.headers[i] = (h, self._irecv(h, a.stage - 1, _tag(a.stage, HEADER)))
            if a.stage in first:
                self.next_on_channel[first[a.stage]] = i
            else:
                self._guess(i)
            first[a.stage] = i

    # ---- sends -------------------------------------------------------------------------
    def send_activation(self, t, stage: int) -> None:
        """``t``, the output of ``stage`` (a tensor or a pytree of them), to ``stage + 1``
        (header, a tree's spec when it changed, the data; first dummies when the receiver
        guessed another message)."""
        key, guess = key_of(t), self.shapes.guess(stage + 1)
        tag = _tag(stage + 1, ACTIVATION)
        if guess is not None and guess != key:
            for dummy in _buffers(guess, self.device):  # fill the guessed receives
                self._isend(dummy, stage + 1, tag)
            self.shapes.dummies += 1
        changed = self.shapes.last(stage + 1) != key
        self.shapes.record(stage + 1, key)
        if pytree.is_bare(t):
            t = t.detach().contiguous()
            self._isend(header_of(t), stage + 1, _tag(stage + 1, HEADER))
            self._isend(t, stage + 1, tag)
            return
        data = [x.detach().contiguous() for x in pytree.leaves(t)]
        for x in data:
            header_of(x)  # refuses a dtype or rank that cannot travel, naming it
        spec = key[1]
        self._isend(tree_header(len(spec), changed), stage + 1, _tag(stage + 1, HEADER))
        if changed:
            self._isend(torch.tensor(spec, dtype=torch.int64), stage + 1, _tag(stage + 1, SPEC))
        for x in data:
            self._isend(x, stage + 1, tag)

    def send_gradient(self, t, stage: int) -> None:
        """``t``, the gradient of ``stage``'s input (a tensor, or the list of a tree's
        gradient leaves: ``pytree.input_grads``), to ``stage - 1``."""
        for g in [t] if isinstance(t, torch.Tensor) else t:
            self._isend(g.detach().contiguous(), stage - 1, _tag(stage - 1, GRADIENT))

    def finish(self) -> None:
        """Wait for the step's sends (keeping their tensors alive until then) and for the
        dummies that filled wrong guesses (gloo writes into those buffers)."""
        for _, works in self.dummies:
            _wait(works)
        _wait(self.sends)
        self.sends, self.dummies = [], []

    # ---- receives ----------------------------------------------------------------------
    def post_ahead(self, i: int) -> None:
        """Post the receives standing before the compute after action ``i`` (whose data
        can arrive while ``i`` runs), as far as their buffers' shapes are known."""
        self._post(self.next_compute[i], block=False)

    def activation(self, stage: int, mb: int, train: bool = False):
        """The input of ``stage`` for micro-batch ``mb`` (waits for it), requiring a
        gradient when ``train``: a bare tensor always, a tree's leaves where the sender's
        needed one (its spec says which)."""
        value = self._take(self.index[(RECV_F, stage, mb)])
        if pytree.is_bare(value):
            return value.requires_grad_(train)
        flags = [leaf.grad for leaf in pytree.spec_leaves(self.specs.pop((stage, mb)))]
        for t, grad in zip(pytree.leaves(value), flags, strict=True):
            t.requires_grad_(train and grad)
        return value

    def gradient(self, stage: int, mb: int):
        """The gradient of ``stage``'s output for micro-batch ``mb`` (waits for it): a
        tensor, or for a tree the list of its gradient leaves' gradients."""
        return self._take(self.index[(RECV_B, stage, mb)])

    def _take(self, i: int) -> torch.Tensor:
        # posts (waiting for headers) the receives of the list up to i: in list order per
        # kind, i.e. the order their one sender sent them in, so no extra wait
        self._post(i + 1, block=True)
        buf, works = self.posted.pop(i)
        _wait(works)
        return buf

    def _post(self, upto: int, block: bool) -> None:
        # in list order per kind: the order each channel's sender sends in
        while self.f_next < len(self.recv_f) and self.recv_f[self.f_next] < upto:
            i = self.recv_f[self.f_next]
            h, works = self.headers[i]
            if not block and not all(w.is_completed() for w in works):
                break
            _wait(works)
            del self.headers[i]
            a = self.actions[i]
            shape = self._key(h, a.stage)
            guessed = self.guessed.pop(i, None)
            if guessed is not None and guessed[0] == shape:
                self.posted[i] = (_value(shape, guessed[1]), guessed[2])
                self.shapes.hits += 1
            else:
                if guessed is not None:  # the sender sends dummies for it first
                    self.dummies.append((guessed[1], guessed[2]))
                    self.shapes.misses += 1
                bufs = _buffers(shape, self.device)
                tag = _tag(a.stage, ACTIVATION)
                works = [w for b in bufs for w in self._irecv(b, a.stage - 1, tag)]
                self.posted[i] = (_value(shape, bufs), works)
            if shape[0] == "tree":
                self.specs[(a.stage, a.mb)] = pytree.decode(shape[1])
            self.shapes.record(a.stage, shape)
            if i in self.next_on_channel:
                self._guess(self.next_on_channel[i])
            self.f_next += 1
        while self.b_next < len(self.recv_b) and self.recv_b[self.b_next] < upto:
            i = self.recv_b[self.b_next]
            a = self.actions[i]
            out = self.outputs.get((a.stage, a.mb))
            if out is None:  # its forward has not run yet: post when the rank gets there
                break
            tag = _tag(a.stage, GRADIENT)
            if pytree.is_bare(out):
                buf = torch.empty_like(out, memory_format=torch.contiguous_format)
                self.posted[i] = (buf, self._irecv(buf, a.stage + 1, tag))
            else:  # the gradients of the tree's leaves that need one, in leaf order
                bufs = [
                    torch.empty_like(t, memory_format=torch.contiguous_format)
                    for t in pytree.grad_leaves(out)
                ]
                works = [w for b in bufs for w in self._irecv(b, a.stage + 1, tag)]
                self.posted[i] = (bufs, works)
            self.b_next += 1

    def _key(self, header: torch.Tensor, stage: int) -> tuple:
        """What the header of ``stage``'s channel announces (``key_of``'s form); a tree's
        new spec is received here (sent right behind its header, so already on the way)."""
        if int(header[0]) != TREE:
            return _shape_of(header)
        if not int(header[2]):
            return self.shapes.last(stage)
        spec = torch.empty(int(header[1]), dtype=torch.int64)
        _wait(self._irecv(spec, stage - 1, _tag(stage, SPEC)))
        return ("tree", tuple(spec.tolist()))

    def _guess(self, i: int) -> None:
        """Post the activation receive of RECV_F action ``i`` before its header, with the
        message its channel's sender will have sent twice in a row (if it has)."""
        stage = self.actions[i].stage
        guess = self.shapes.guess(stage)
        if guess is not None:
            bufs = _buffers(guess, self.device)
            tag = _tag(stage, ACTIVATION)
            works = [w for b in bufs for w in self._irecv(b, stage - 1, tag)]
            self.guessed[i] = (guess, bufs, works)

    def _peer(self, stage: int) -> int:
        return self.rank_of(stage)

    def _isend(self, t: torch.Tensor, stage: int, tag: int) -> None:
        self.sends += comm.batch_p2p(
            self.group, sends=[(t, self._peer(stage))], label="pp_p2p", tag=tag
        )

    def _irecv(self, t: torch.Tensor, stage: int, tag: int) -> list:
        return comm.batch_p2p(self.group, recvs=[(t, self._peer(stage))], label="pp_p2p", tag=tag)


def _wait(works) -> None:
    for w in works:
        w.wait()
