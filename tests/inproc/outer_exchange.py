"""Drive a node's outer-exchange handler the way a partner does: a round is open and the
node has accepted the sender's proposal, so the payload gets past the reservation check
to the decoding and the screens."""

import asyncio

from swarm_node.node import Node
from swarm_node.wire.codec import encode_frame

OUR_ANSWER = encode_frame({"kind": "outer", "ok": True})  # stands in for our (phi, Delta)


async def exchange_as_partner(node: Node, remote: str, frame: bytes) -> bytes:
    pairing = node.pairing
    round_task = asyncio.create_task(pairing.run_round(0, OUR_ANSWER, candidates=lambda: [], propose=None,
                                                       send=None, expect_request=True))
    try:
        await pairing.seeking.wait()
        pairing.on_propose(remote)
        return await node._handle_outer(remote, frame)
    finally:
        round_task.cancel()  # a refused payload leaves the round seeking: end it here
        await asyncio.gather(round_task, return_exceptions=True)
