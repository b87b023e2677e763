"""The outer round: the round and its pairing proposals (exchange.py), the payloads both
ways between partners (payloads.py), the NoLoCo pairing rule and DiLoCo's group round
(pairing.py, group.py), and the checks a partner's update must pass (partner_check.py)."""
