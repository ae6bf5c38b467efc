"""``distributed.silence.explain_failure`` on what a rank knows when a collective fails:
the heartbeats it reads from the store and the error gloo raised."""

from __future__ import annotations

import time
from dataclasses import dataclass

from meshtrain.distributed.silence import explain_failure


@dataclass
class Beats:
    """What a rank's heartbeat reader returns: every rank's last beat."""

    heard: dict
    every: float = 1.0
    store_address: tuple = ("10.0.0.1", 29500)

    def read(self, world: int):
        return self.heard


def _beat(node: int, address: str, ago: float) -> dict:
    return {"node_rank": node, "address": address, "time": time.time() - ago, "groups": []}


FAILED = ("dp", [0, 1], 33, "reduce_scatter")
CLOSED = (
    "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:48361. This is "
    "typically caused by a remote worker crashing."
)


def test_a_peer_that_closed_its_connection_is_named_though_it_beat_recently():
    """A killed node's ranks close their sockets at once, before their heartbeat goes
    stale: the address gloo names is the rank's, and the line says its process ended."""
    beats = Beats({0: _beat(0, "10.0.0.1", 0.1), 1: _beat(1, "10.0.0.2", 1.5)})
    line = explain_failure(FAILED, CLOSED, 6.0, 0, 2, "10.0.0.1", beats)
    assert line.startswith(
        "reduce_scatter #33 on the dp group failed (connection closed by 10.0.0.2): "
    )
    assert "rank 1 (node 1, 10.0.0.2; last heard 1.5 s ago) closed the connection" in line
    assert line.endswith("its process ended (killed or crashed)")


def test_no_claim_without_evidence():
    """Every peer beats and gloo names an address no rank beat from, or the error is not
    a closed connection: nothing is claimed (the traceback is the story)."""
    beats = Beats({0: _beat(0, "10.0.0.1", 0.1), 1: _beat(1, "10.0.0.2", 0.2)})
    other = CLOSED.replace("10.0.0.2", "10.0.0.9")
    assert explain_failure(FAILED, other, 6.0, 0, 2, "10.0.0.1", beats) is None
    assert explain_failure(FAILED, "RuntimeError: bad shape", 6.0, 0, 2, "x", beats) is None


TIMED_OUT = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 6000ms for recv"


def _at(beat: dict, entered: int) -> dict:
    beat["groups"] = [{"group": "dp", "ranks": [0, 1], "entered": entered}]
    return beat


def test_a_timeout_while_the_peer_beats_names_the_peer_that_has_not_entered():
    """The peer is alive (a slow first step, a longer data load) but elsewhere: the line
    says the collective timed out and that rank 1 had not entered it, with how far it had
    come on the group; gloo's "Timed out waiting 6000ms for recv" says none of that."""
    beats = Beats({0: _at(_beat(0, "10.0.0.1", 0.1), 33), 1: _at(_beat(1, "10.0.0.2", 0.4), 0)})
    line = explain_failure(FAILED, TIMED_OUT, 6.0, 0, 2, "10.0.0.1", beats)
    head = "reduce_scatter #33 on the dp group timed out after 6 s: rank 1 (node 1, 10.0.0.2; "
    assert line.startswith(head + "alive, heard "), line
    assert line.endswith(" s ago, then at #0) has not entered it"), line


def test_a_timeout_inside_the_collective_on_every_rank_claims_nothing():
    """Every peer beats and had entered the collective too: not a late peer (a mismatch, a
    backend fault), so the traceback stays the story."""
    beats = Beats({0: _at(_beat(0, "10.0.0.1", 0.1), 33), 1: _at(_beat(1, "10.0.0.2", 0.2), 33)})
    assert explain_failure(FAILED, TIMED_OUT, 6.0, 0, 2, "10.0.0.1", beats) is None
