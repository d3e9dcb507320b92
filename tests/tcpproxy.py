"""A TCP proxy a test can make stop forwarding: a hung primary as the network shows it.

Frozen, it keeps every socket open and reads nothing (its kernel still acknowledges what
fits in the buffers, and answers TCP keepalives), and it accepts new connections that never
get an answer: what a client sees of a frozen host, a proxy that stopped forwarding, or a
partition behind a load balancer.
"""

from __future__ import annotations

import select
import socket
import threading
from contextlib import suppress


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thawed = threading.Event()
        self._thawed.set()
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        #: The local ports of the proxy's connections to the target (pg_stat_activity's
        #: client_port of the sessions made through it).
        self.upstream_ports: set[int] = set()
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def freeze(self) -> None:
        """Stop forwarding anything, in either direction, on every connection, old or new."""
        self._thawed.clear()

    def close(self) -> None:
        self._closed = True
        self._thawed.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            if not self._thawed.is_set():
                continue  # accepted by the kernel, never answered
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.append(upstream)
                self.upstream_ports.add(upstream.getsockname()[1])
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed:
                self._thawed.wait()
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready or not self._thawed.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # closed under it
            pass
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
