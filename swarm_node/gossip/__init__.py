"""The outer round: the exchange with a partner (exchange.py), the NoLoCo pairing rule and
DiLoCo's group round (pairing.py, group.py), and the checks a partner's update must pass
(partner_check.py)."""
