"""A relay between an S3 client and the test server that breaks some object reads, as a real network and a busy
store do: a connection cut in the middle of a GET's body ("reset"), or the store answering 503 SlowDown
("throttle"). The faults are applied in order to the ranged GETs (object reads) passing through; everything else
is passed on as it is. Each request is sent to the server with `Connection: close`, so one connection carries one
request and the relay needs no HTTP framing beyond the request's head (read-only use: no request bodies)."""
from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultyRelay:
    def __init__(self, endpoint: str, faults: list[str]):
        target = urlparse(endpoint)
        self.target = (target.hostname, target.port)
        self.faults = list(faults)
        self.injected: list[str] = []     # the faults applied, in order
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            fault = None
            if head.startswith(b"GET ") and b"\r\nrange:" in head.lower():
                with self.lock:
                    fault = self.faults.pop(0) if self.faults else None
                    if fault:
                        self.injected.append(fault)
            if fault == "throttle":
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                             + str(len(SLOW_DOWN)).encode() + b"\r\nConnection: close\r\n\r\n" + SLOW_DOWN)
                return
            response = self._forward(_closing(head))
            if fault == "reset":
                end = response.index(b"\r\n\r\n") + 4
                response = response[:end + max(0, (len(response) - end) // 2)]
            conn.sendall(response)

    def _forward(self, request: bytes) -> bytes:
        with socket.create_connection(self.target) as upstream:
            upstream.sendall(request)
            chunks = []
            while True:
                data = upstream.recv(1 << 20)
                if not data:
                    return b"".join(chunks)
                chunks.append(data)


def _closing(head: bytes) -> bytes:
    """The request's head with `Connection: close` in place of any Connection header."""
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    at = lines.index(b"")
    return b"\r\n".join(lines[:at] + [b"Connection: close"] + lines[at:])
