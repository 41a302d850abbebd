"""An example third-party backend: ranks on one machine talk over Unix domain sockets.

It implements only rank, size, send and recv; every collective, split and barrier
comes from meshcomm's generic algorithms. It is what docs/writing-a-backend.md
describes, installed by the test suite without touching meshcomm itself.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import numpy as np
from meshcomm.plugin import (
    Backend,
    BackendRegistrar,
    CommTimeoutError,
    Config,
    JobSpec,
    PeerLostError,
    hookimpl,
    setting,
)
from pydantic import BaseModel

_LEN = struct.Struct("<Q")


class UdsSettings(BaseModel):
    dir: Path | None = setting(
        None,
        env="MESHCOMM_UDS_DIR",
        accepts="a directory shared by the ranks",
        description="where the ranks' sockets live",
    )


class UdsBackend(Backend):
    def __init__(self, directory: Path, rank: int, size: int, timeout: float) -> None:
        self._rank, self._size, self.timeout = rank, size, timeout
        self.conns: dict[int, socket.socket] = {}
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(directory / f"{rank}.sock"))
        listener.listen(size)
        deadline = time.monotonic() + timeout
        for q in range(rank):  # connect to lower ranks, then accept higher ones
            path = str(directory / f"{q}.sock")
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path)
                    s.sendall(_LEN.pack(rank))
                    break
                except OSError:
                    s.close()
                    if time.monotonic() > deadline:
                        raise CommTimeoutError(
                            f"[uds] rank {rank}: rank {q} never listened at {path}", peer=q
                        ) from None
                    time.sleep(0.02)
            self.conns[q] = s
        listener.settimeout(timeout)
        for _ in range(rank + 1, size):
            s, _addr = listener.accept()
            (q,) = _LEN.unpack(self._read(s, _LEN.size, -1))
            self.conns[q] = s
        listener.close()
        for s in self.conns.values():
            s.settimeout(timeout)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _read(self, s: socket.socket, n: int, peer: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = s.recv_into(view[got:])
            except TimeoutError:
                raise CommTimeoutError(
                    f"[uds] rank {self._rank}: rank {peer} sent nothing for {self.timeout} s", peer=peer
                ) from None
            if k == 0:
                raise PeerLostError(f"[uds] rank {self._rank}: rank {peer} closed its connection", peer=peer)
            got += k
        return bytes(buf)

    def send(self, buf: np.ndarray, dst: int) -> None:
        try:
            self.conns[dst].sendall(_LEN.pack(buf.nbytes) + buf.tobytes())
        except OSError as exc:
            raise PeerLostError(f"[uds] rank {self._rank}: cannot send to rank {dst}: {exc}", peer=dst) from None

    def recv(self, buf: np.ndarray, src: int) -> None:
        (n,) = _LEN.unpack(self._read(self.conns[src], _LEN.size, src))
        if n != buf.nbytes:
            raise ValueError(f"[uds] rank {self._rank}: rank {src} sent {n} bytes, expected {buf.nbytes}")
        buf.view(np.uint8)[:] = np.frombuffer(self._read(self.conns[src], n, src), np.uint8)

    def close(self) -> None:
        for s in self.conns.values():
            s.close()


def _environment(config: Config, settings: UdsSettings) -> str | None:
    # rank and world size come from the core's Config (MLX_RANK/MLX_WORLD_SIZE, or any
    # launcher's variables); a backend adds only its own settings
    if settings.dir is None or config.world_size is None or config.rank is None:
        return "needs MESHCOMM_UDS_DIR, MLX_WORLD_SIZE and MLX_RANK"
    return None


def _factory(config: Config, settings: UdsSettings) -> Backend:
    assert settings.dir is not None and config.rank is not None and config.world_size is not None
    return UdsBackend(settings.dir, config.rank, config.world_size, config.timeout)


class _Launcher:
    def rank_env(self, job: JobSpec) -> list[dict[str, str]]:
        return [{"MESHCOMM_UDS_DIR": str(job.dir)} for _ in job.places]


@hookimpl
def meshcomm_register_backends(register: BackendRegistrar) -> None:
    register(
        "uds",
        factory=_factory,
        environment=_environment,
        settings=UdsSettings,
        launcher=_Launcher(),
        priority=50,
        description="example: Unix domain sockets",
    )
