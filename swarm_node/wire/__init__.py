"""Wire formats: pure encoding and decoding, no I/O."""

from swarm_node.wire.frames import DEFAULT_LIMITS, WIRE_VERSION, FrameLimits, decode_frame, encode_frame

__all__ = ["DEFAULT_LIMITS", "WIRE_VERSION", "FrameLimits", "decode_frame", "encode_frame"]
