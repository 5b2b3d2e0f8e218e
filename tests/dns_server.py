"""A small authoritative DNS server over UDP, standard library only, for tests that
resolve through the system's resolver (glibc's getaddrinfo) rather than a fake.

Each name has a sequence of A answers: the first A query gets the first, each later
one the next, the last repeated (one entry: a fixed answer; two: an answer that
changes, as in DNS rebinding). AAAA and other types of a known name get an empty
answer (NODATA); an unknown name gets NXDOMAIN. Every answer has TTL 0, so nothing
between the server and its client may keep one. Every query is logged, one JSON
line each, so a test can count what was asked and what was answered.

Run as ``python -m tests.dns_server --listen ADDRESS --zone JSON --log FILE`` (port 53
unless ``--port``); it writes ``ready`` to stdout once it listens.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

TYPE_A = 1
TYPE_AAAA = 28
TYPE_NAMES = {TYPE_A: "A", TYPE_AAAA: "AAAA"}
CLASS_IN = 1
NXDOMAIN = 3
FORMERR = 1


class Zone:
    def __init__(self, answers: Mapping[str, Sequence[Sequence[str]]]) -> None:
        self.answers = {
            name.lower().rstrip("."): [list(a) for a in seq] for name, seq in answers.items()
        }
        self.asked: dict[str, int] = {}
        self.lock = threading.Lock()

    def answer(self, name: str, qtype: int) -> list[str] | None:
        """The addresses for this query (None: the name is unknown)."""
        sequence = self.answers.get(name)
        if sequence is None:
            return None
        if qtype != TYPE_A:
            return []
        with self.lock:
            number = self.asked.get(name, 0)
            self.asked[name] = number + 1
        return sequence[min(number, len(sequence) - 1)]


def parse_question(packet: bytes) -> tuple[int, int, str, int, bytes]:
    """(id, flags, name, qtype, the question's bytes as sent) of a query with one question."""
    if len(packet) < 12:
        raise ValueError("shorter than a header")
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    labels = []
    at = 12
    while True:
        length = packet[at]
        if length == 0:
            at += 1
            break
        if length & 0xC0:
            raise ValueError("a compressed name in a question")
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii"))
        at += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[at : at + 4])
    return ident, flags, ".".join(labels).lower(), qtype, packet[12 : at + 4]


def respond(packet: bytes, zone: Zone) -> tuple[bytes, dict[str, object]]:
    """The response to ``packet``, and what to log of it."""
    try:
        ident, flags, name, qtype, question = parse_question(packet)
    except (ValueError, IndexError, struct.error) as exc:
        ident = struct.unpack("!H", packet[:2])[0] if len(packet) >= 2 else 0
        header = struct.pack("!HHHHHH", ident, 0x8000 | FORMERR, 0, 0, 0, 0)
        return header, {"error": str(exc)}
    addresses = zone.answer(name, qtype)
    records = b""
    for address in addresses or ():
        # The owner name is a pointer to the question's (offset 12).
        records += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 0, 4)
        records += ipaddress.IPv4Address(address).packed
    rcode = NXDOMAIN if addresses is None else 0
    # A response (QR), authoritative (AA), the query's opcode and RD echoed, RA set.
    reply_flags = 0x8000 | (flags & 0x7900) | 0x0400 | 0x0080 | rcode
    count = len(addresses or ())
    header = struct.pack("!HHHHHH", ident, reply_flags, 1, count, 0, 0)
    logged: dict[str, object] = {
        "name": name,
        "type": TYPE_NAMES.get(qtype, str(qtype)),
        "answer": addresses,
    }
    return header + question + records, logged


def serve(sock: socket.socket, zone: Zone, log: Path) -> None:
    with log.open("a") as sink:
        while True:
            packet, peer = sock.recvfrom(4096)
            reply, logged = respond(packet, zone)
            # Logged before it is sent: a client that has the answer finds its query logged.
            sink.write(json.dumps(logged) + "\n")
            sink.flush()
            sock.sendto(reply, peer)


def read_log(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--zone", required=True, help='{"name": [["1.2.3.4"], ...]}')
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((args.listen, args.port))
    print("ready", flush=True)
    serve(sock, Zone(json.loads(args.zone)), args.log)


if __name__ == "__main__":
    main()
