"""Ask one DNS server for one A record: `dns_query.py SERVER NAME [EXPECTED_IP]`.
Exit 0 when it answers (with EXPECTED_IP, if given). No dig or nslookup on this machine."""

import random
import socket
import struct
import sys


def query(server: str, name: str, timeout: float = 2.0) -> list[str]:
    qid = random.randrange(1 << 16)
    packet = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    packet += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    packet += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(packet, (server, 53))
        data = s.recv(4096)
    rid, flags, qd, an = struct.unpack(">HHHH", data[:8])
    if rid != qid or flags & 0x000F:
        return []
    pos = 12
    for _ in range(qd):
        while data[pos]:
            pos += data[pos] + 1
        pos += 5
    answers = []
    for _ in range(an):
        pos += 2 if data[pos] & 0xC0 == 0xC0 else len(data[pos:].split(b"\0", 1)[0]) + 1
        rtype, _, _, rdlen = struct.unpack(">HHIH", data[pos:pos + 10])
        pos += 10
        if rtype == 1:
            answers.append(socket.inet_ntoa(data[pos:pos + 4]))
        pos += rdlen
    return answers


if __name__ == "__main__":
    got = query(sys.argv[1], sys.argv[2])
    print(" ".join(got))
    ok = bool(got) and (len(sys.argv) < 4 or sys.argv[3] in got)
    raise SystemExit(0 if ok else 1)
