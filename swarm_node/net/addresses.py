"""What per-address caps count a remote caller under.

Peer ids cost nothing to make, addresses do: caps per remote address keep a handful of
hosts from taking every slot with fresh identities. What one host has is one IPv4
address, but a whole IPv6 /64 (the prefix one subscriber gets: its hosts draw 2^64
addresses from it at will), so IPv6 callers are counted by /64. An IPv4 address seen
through an IPv6 socket (::ffff:a.b.c.d) is that IPv4 address.

Loopback is every process of this machine at once, and a local tunnel or reverse proxy
(ssh -L, kubectl port-forward, docker-proxy) makes callers from anywhere look local too:
it gets a key of its own, ``LOOPBACK``, and each cap says what it allows there."""

from __future__ import annotations

import ipaddress

LOOPBACK = "loopback"
IPV6_PREFIX_BITS = 64

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(text: str) -> IP | None:
    """An IP from a socket's or a multiaddr's text (a scope such as %eth0 dropped), or None."""
    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def address_key(ip: IP | str | None) -> str | None:
    """The key of a remote IP for per-address caps: the IPv4 address, the IPv6 /64, or
    ``LOOPBACK``; None for what is not an IP (then only the other caps apply)."""
    if isinstance(ip, str):
        ip = parse_ip(ip)
    elif isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip is None:
        return None
    if ip.is_loopback:
        return LOOPBACK
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX_BITS), strict=False))
    return str(ip)
