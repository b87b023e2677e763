"""Which stage a joining node takes. Pure functions of the registry as this node reads
it, so every joiner computes the same assignment from the same records."""

from __future__ import annotations

from swarm_node.wire.records import PeerRecord

Peers = dict[int, dict[str, PeerRecord]]  # stage -> peer -> its record (ours excluded)


def assign_stage(peers: Peers, own_id: str, num_stages: int, reachable: bool) -> int:
    """Joiners others cannot dial take stage 0 (it only calls out); the others, in
    peer-id order, each take the stage with the fewest peers (ties: the lower total
    throughput, then the lower index). Peers are counted rather than weighted by
    throughput because the throughputs of different stages are not comparable
    (stage 0 measures the whole pipeline's latency)."""
    if not reachable:
        return 0
    stages = range(num_stages)
    count = {s: sum(r.state == "training" for r in peers.get(s, {}).values()) for s in stages}
    speed = {s: sum(r.throughput for r in peers.get(s, {}).values() if r.state == "training") for s in stages}
    joining = {p: r for s in stages for p, r in peers.get(s, {}).items() if r.state == "joining"}
    count[0] += sum(not r.reachable for r in joining.values())
    joiners = sorted({own_id, *(p for p, r in joining.items() if r.reachable)})
    for peer in joiners:
        best = min(stages, key=lambda s: (count[s], speed[s], s))
        if peer == own_id:
            return best
        count[best] += 1
    raise AssertionError("not reached: this node is among the joiners")


def rebalanced_stage(peers: Peers, own_id: str, stage: int, num_stages: int, reachable: bool) -> int:
    """``stage``, or another one when we are the newest movable id of our stage and

    - the stages as announced differ by two or more peers and ours is a fullest: we take
      an emptiest one. Joiners that did not see each other in time (records spread
      through the DHT in seconds) even out this way;
    - or stage 0 holds only peers nobody can dial and ours holds two or more: we take
      stage 0. Peers behind a NAT cannot pair with each other (they only call out), so
      without a reachable peer beside them they train alone, however balanced the
      counts.

    Nobody behind a NAT moves: it can only hold stage 0."""
    stages = range(num_stages)
    announced = {s: [p for p, r in peers.get(s, {}).items() if r.state in ("training",
                                                                           "joining")] for s in stages}
    announced[stage].append(own_id)
    count = {s: len(members) for s, members in announced.items()}
    stranded = stage != 0 and count[stage] >= 2 and bool(announced[0]) and not any(
        peers[0][p].reachable for p in announced[0])
    uneven = max(count.values()) - min(count.values()) >= 2 and count[stage] == max(count.values())
    if not reachable or not (stranded or uneven):
        return stage
    movable = [p for p in announced[stage] if p == own_id or (
        peers[stage][p].state == "joining" and peers[stage][p].reachable)]
    if max(movable) != own_id:
        return stage
    return 0 if stranded else min(stages, key=lambda s: (count[s], s))
