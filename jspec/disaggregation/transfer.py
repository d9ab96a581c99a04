"""The link between a prefill engine and a decode engine: framed messages (a JSON header and
numpy arrays) behind one interface, `Link`.

"socket": the arrays follow the header in the TCP stream (works between hosts). "shm": they
go into a /dev/shm file the receiver maps read-only and unlinks at once (one host, one copy);
the sender fills it with write(), not through a mapping, which faults page by page. Files of
a sender that died are found by their pid prefix and unlinked (`sweep_orphans`).
Frame: 4-byte magic, u32 header length, u64 body length, the header, the body.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import socket
import struct
import threading

import ml_dtypes
import numpy as np

MAGIC = b"JSPD"
_PREFIX = struct.Struct("!4sIQ")
BACKENDS = ("socket", "shm")
_SHM_DIR = "/dev/shm"


class LinkClosed(ConnectionError):
    """The peer went away (closed, crashed or was killed), possibly in the middle of a message."""


def host_id() -> str:
    """Names this machine (boot instance included): the shm backend needs both ends on one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r} must be HOST:PORT")
    return host, int(port)


def _array_meta(arrays) -> list[dict]:
    return [{"dtype": a.dtype.str if a.dtype.kind != "V" else str(a.dtype), "shape": list(a.shape)} for a in arrays]


def dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _bytes(a: np.ndarray) -> memoryview:
    # Through uint8: memoryview refuses dtypes outside the buffer protocol (bfloat16).
    return memoryview(a.reshape(-1).view(np.uint8))


def _nbytes(header: dict) -> int:
    return sum(int(np.prod(m["shape"], dtype=np.int64)) * dtype(m["dtype"]).itemsize for m in header.get("arrays", []))


class Link:
    """One bidirectional connection; send() is thread-safe, recv() belongs to one reader thread."""

    backend = "socket"

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0
        self.peer_pid: int | None = None

    # ---- sending ----------------------------------------------------------------------------

    def send(self, header: dict, arrays=()) -> int:
        """Sends one message; returns the array bytes it carried."""
        arrays = [np.asarray(a) if np.asarray(a).flags.c_contiguous else np.asarray(a).copy() for a in arrays]
        header = dict(header, arrays=_array_meta(arrays))
        with self._send_lock:
            try:
                body = self._put_arrays(header, arrays)
                head = json.dumps(header).encode()
                self.sock.sendall(_PREFIX.pack(MAGIC, len(head), sum(len(b) for b in body)) + head)
                for b in body:
                    self.sock.sendall(b)
            except OSError as e:
                raise LinkClosed(f"link to {self.peer} failed while sending: {e}") from e
        n = sum(a.nbytes for a in arrays)
        self.bytes_sent += n
        return n

    def _put_arrays(self, header: dict, arrays) -> list[memoryview]:
        return [_bytes(a) for a in arrays if a.nbytes]

    # ---- receiving --------------------------------------------------------------------------

    def recv(self) -> tuple[dict, list[np.ndarray]]:
        """The next message; LinkClosed if the peer is gone, saying how far the message got."""
        prefix = self._read_exact(_PREFIX.size, "a message")
        magic, head_len, body_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise LinkClosed(f"link to {self.peer}: not a jspec PD peer (bad frame magic {magic!r})")
        header = json.loads(bytes(self._read_exact(head_len, "a message header")))
        body = (
            self._read_exact(body_len, f"a {header.get('type', '?')} message for request {header.get('rid', '?')!r}")
            if body_len
            else None
        )
        arrays = self._take_arrays(header, body)
        self.bytes_received += sum(a.nbytes for a in arrays)
        return header, arrays

    def _take_arrays(self, header: dict, body) -> list[np.ndarray]:
        if _nbytes(header) != (len(body) if body is not None else 0):
            raise LinkClosed(f"link to {self.peer}: a message's arrays do not add up to its body")
        out, off = [], 0
        for m in header.get("arrays", []):
            dt = dtype(m["dtype"])
            n = int(np.prod(m["shape"], dtype=np.int64)) * dt.itemsize
            out.append(
                np.frombuffer(body, dt, n // dt.itemsize, off).reshape(m["shape"]) if n else np.zeros(m["shape"], dt)
            )
            off += n
        return out

    def _read_exact(self, n: int, what: str) -> memoryview:
        buf = np.empty(n, np.uint8)  # not bytearray(n): zero-filling a GB-sized payload costs ~0.1 s
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], min(n - got, 1 << 24))
            except OSError as e:
                raise LinkClosed(f"link to {self.peer} failed after {got} of {n} bytes of {what}: {e}") from e
            if k == 0:
                if not got and what == "a message":
                    raise LinkClosed(f"{self.peer} closed the link")
                raise LinkClosed(f"{self.peer} closed the link after {got} of {n} bytes of {what}")
            got += k
        return view

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def sweep_orphans(self) -> int:
        return 0


class ShmLink(Link):
    """Arrays through a shared-memory file per message (same host only)."""

    backend = "shm"
    _counter = itertools.count()

    def _put_arrays(self, header: dict, arrays) -> list[memoryview]:
        total = sum(a.nbytes for a in arrays)
        if not total:
            return []
        if os.path.isdir(_SHM_DIR):
            st = os.statvfs(_SHM_DIR)
            free = st.f_bavail * st.f_frsize
            # Say why in words before writing a GB into a tmpfs that cannot hold it.
            if total > free:
                raise OSError(
                    f"{_SHM_DIR} has {free / 2**20:.0f} MiB free and this transfer needs "
                    f"{total / 2**20:.0f} MiB: enlarge it (docker --shm-size) or use the socket backend"
                )
        name = f"jspd_{os.getpid()}_{next(self._counter)}"
        path = os.path.join(_SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            for a in arrays:
                view = _bytes(a)
                while view:
                    view = view[os.write(fd, view) :]
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        header["shm"] = name
        return []

    def _take_arrays(self, header: dict, body) -> list[np.ndarray]:
        name = header.get("shm")
        if name is None:
            return super()._take_arrays(header, body)
        if os.path.basename(name) != name or not name.startswith("jspd_"):
            raise LinkClosed(f"link to {self.peer}: {name!r} is not a jspec transfer file")
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise LinkClosed(f"shared-memory file {name} from {self.peer} is gone") from e
        try:
            size = os.fstat(fd).st_size
            if size != _nbytes(header):
                raise LinkClosed(
                    f"link to {self.peer}: shared-memory file {name} holds {size} bytes, the "
                    f"message's arrays {_nbytes(header)}"
                )
            # The arrays are views of this mapping; it is unmapped when the last of them goes.
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
            os.unlink(path)
        return super()._take_arrays(header, data)

    def sweep_orphans(self) -> int:
        """Unlinks files the peer created but never handed over (it died mid-transfer)."""
        if self.peer_pid is None or not os.path.isdir(_SHM_DIR):
            return 0
        n = 0
        for f in os.listdir(_SHM_DIR):
            if f.startswith(f"jspd_{self.peer_pid}_"):
                try:
                    os.unlink(os.path.join(_SHM_DIR, f))
                    n += 1
                except FileNotFoundError:
                    pass
        return n


def make_link(sock: socket.socket, peer: str, backend: str) -> Link:
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose from {BACKENDS}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return (ShmLink if backend == "shm" else Link)(sock, peer)


def connect(addr: str, backend: str, timeout: float = 5.0) -> Link:
    host, port = parse_addr(addr)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise LinkClosed(f"cannot reach the prefill engine at {addr}: {e}") from e
    sock.settimeout(None)
    return make_link(sock, addr, backend)
