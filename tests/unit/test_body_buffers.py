"""Big lane bodies are read into buffers used again once nothing views them
(net/lane_io.py BodyBuffers): never one still viewed, however its view was sliced."""

import gc

from swarm_node.net.lane_io import BodyBuffers

MB = 1 << 20


def test_a_buffer_nothing_views_is_used_again_and_a_viewed_one_never():
    buffers = BodyBuffers(keep=2)
    first = buffers.take(3 * MB)
    first[:4] = b"abcd"
    part = first[1:3]  # a handler's slice of the body
    del first
    second = buffers.take(3 * MB)  # the first is still viewed through `part`
    assert buffers.reused == 0 and bytes(part) == b"bc"
    second[:4] = b"wxyz"
    assert bytes(part) == b"bc"
    del part, second
    gc.collect()
    third = buffers.take(3 * MB)
    assert buffers.reused == 1 and len(third) == 3 * MB


def test_sizes_far_apart_take_their_own_buffers_and_only_keep_are_kept():
    buffers = BodyBuffers(keep=2)
    for n in (8 * MB, 3 * MB, 1 * MB):  # each view dropped at once: free, but sizes too far apart
        buffers.take(n)
    assert buffers.reused == 0 and len(buffers._buffers) == 2
    assert len(buffers.take(int(1.5 * MB))) == int(1.5 * MB) and buffers.reused == 1  # the 3 MB one


def test_a_body_too_big_to_keep_is_not_kept():
    buffers = BodyBuffers(keep=2, max_kept_bytes=2 * MB)
    buffers.take(3 * MB)
    buffers.take(3 * MB)
    assert buffers.reused == 0 and not buffers._buffers
