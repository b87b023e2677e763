"""The test bed itself: the round-trip times and rates it is asked for are the ones
measured between its hosts, a host behind NAT can dial out but not be dialled, and
nothing of a bed outlives it (errors and Ctrl-C included)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time

import pytest
from netbed import TestBed, remove_leftovers
from netbed.bed import PREFIX, _namespaces


def _listen(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(128)  # nobody accepts: connections only need to complete their handshake
    return server


def _connect_times_ms(address: str, port: int, count: int = 7) -> list[float]:
    """A TCP connect takes one round trip (SYN, SYN-ACK)."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        with socket.create_connection((address, port), timeout=5):
            times.append((time.perf_counter() - started) * 1e3)
    return times


def _send(address: str, port: int, size: int) -> float:
    """Seconds to push ``size`` bytes and have the receiver confirm them."""
    payload = b"x" * size
    started = time.perf_counter()
    with socket.create_connection((address, port), timeout=30) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(16) == b"done"
    return time.perf_counter() - started


def _receive_once(server: socket.socket) -> tuple[int, str]:
    conn, (peer, _) = server.accept()
    with conn:
        received = 0
        while chunk := conn.recv(1 << 16):
            received += len(chunk)
        conn.sendall(b"done")
    return received, peer


def test_round_trip_times_add_up_per_access_link(bed):
    far, near, plain = bed.add_host("far", rtt_ms=40), bed.add_host("near", rtt_ms=20), bed.add_host("plain")
    servers = [bed.call(host, _listen, 5000) for host in (near, plain)]
    try:
        for client, server, wanted in ((plain, near, 20), (far, near, 60), (far, plain, 40), (near, plain,
                                                                                              20)):
            assert bed.rtt_ms_between(client, server) == wanted
            times = bed.call(client, _connect_times_ms, server.address, 5000)[1:]  # the first also does ARP
            # never faster than asked; the userspace stage adds scheduling delay on a busy machine
            assert wanted - 1 <= min(times) and statistics.median(times) <= wanted + 25, (client.name, times)
    finally:
        for server in servers:
            server.close()


def test_rates_shape_upload_and_download(bed):
    sender, receiver = bed.add_host("up", rate_mbit=8, rtt_ms=10), bed.add_host("down")
    server = bed.call(receiver, _listen, 5001)
    try:
        # 3 s at 8 Mbit/s: long enough that the shaped rate, not a loaded machine's
        # scheduling of the delay stage and the receiver (half a second seen), sets the times
        size = 3_000_000
        sent_before = bed.tx_bytes(sender)
        with bed_thread(bed, receiver, _receive_once, server) as received:
            seconds = bed.call(sender, _send, receiver.address, 5001, size)
        assert received() == (size, sender.address)
        assert 2.9 <= seconds <= 6.0, seconds  # 3 s of payload at 8 Mbit/s, plus start-up and headers
        # the payload and its headers, counted
        assert size <= bed.tx_bytes(sender) - sent_before <= size * 1.1
        # Shaped again, lower: at the old rate half the payload would take 1.5 s, at the new
        # one 3 s. (Shaping higher and timing it measured the machine instead: the userspace
        # delay stage, not the link, set a faster transfer's time on a loaded machine.)
        bed.shape(sender, 4)
        with bed_thread(bed, receiver, _receive_once, server) as received:
            slower = bed.call(sender, _send, receiver.address, 5001, size // 2)
        assert received()[0] == size // 2 and slower >= 2.9, (slower, seconds)
    finally:
        server.close()


def test_a_host_behind_nat_dials_out_but_cannot_be_dialled(bed, iptables):
    home, public = bed.add_host("home", behind_nat=True), bed.add_host("pub")
    assert home.address != home.public_address
    server = bed.call(public, _listen, 5002)
    home_server = bed.call(home, _listen, 5003)
    try:
        with bed_thread(bed, public, _receive_once, server) as received:
            bed.call(home, _send, public.address, 5002, 1000)
        assert received() == (1000, home.public_address)  # seen from the router's address
        for address in (home.address, home.public_address):
            with pytest.raises(OSError):
                bed.call(public, _connect_times_ms, address, 5003, 1)
    finally:
        server.close()
        home_server.close()


def test_nothing_of_a_bed_outlives_it_not_even_after_ctrl_c(can_build_beds):
    with pytest.raises(KeyboardInterrupt), TestBed("c") as bed:
        host = bed.add_host("a", rtt_ms=10)
        sleeper = bed.popen(host, ["sleep", "600"])
        relays = list(bed._relays)
        raise KeyboardInterrupt
    assert not [n for n in _namespaces() if n.startswith(bed.prefix)]
    assert sleeper.poll() is not None and all(r.poll() is not None for r in relays)


def test_leftovers_of_a_killed_run_are_removed(can_build_beds):
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}-{dead.pid}-x-wan"
    subprocess.run(["ip", "netns", "add", name], check=True)
    remove_leftovers()
    assert name not in _namespaces()


class bed_thread:
    """Runs ``fn`` on ``host`` in the background; calling the context value joins it."""

    def __init__(self, bed: TestBed, host, fn, *args):
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._future = self._pool.submit(bed.call, host, fn, *args)

    def __enter__(self):
        return lambda: self._future.result(timeout=30)

    def __exit__(self, *exc):
        self._pool.shutdown(wait=True)
