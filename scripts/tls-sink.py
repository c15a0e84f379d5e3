#!/usr/bin/env python3
"""TCP + TLS 1.3 bulk transfer for scripts/lossy-tun.sh: a server that reads LEN bytes and
answers one byte, and a client that sends a file and waits for that byte.

    tls-sink.py serve CERT KEY HOST PORT LEN
    tls-sink.py send CA HOST PORT FILE CONGESTION
"""

import socket
import ssl
import sys


def serve(cert, key, host, port, length):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    with socket.create_server((host, int(port))) as listener:
        conn, _ = listener.accept()
        with context.wrap_socket(conn, server_side=True) as tls:
            left = int(length)
            while left > 0:
                chunk = tls.recv(min(left, 1 << 20))
                if not chunk:
                    sys.exit(f"connection ended with {left} bytes missing")
                left -= len(chunk)
            tls.sendall(b"k")


def send(ca, host, port, path, congestion):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(ca)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
        # The sending side's congestion control is the one that matters for a bulk upload.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        conn.connect((host, int(port)))
        with context.wrap_socket(conn, server_hostname="localhost") as tls:
            with open(path, "rb") as source:
                while chunk := source.read(1 << 20):
                    tls.sendall(chunk)
            if tls.recv(1) != b"k":
                sys.exit("no acknowledgement")


if __name__ == "__main__":
    {"serve": serve, "send": send}[sys.argv[1]](*sys.argv[2:])
