"""The gloo transport: meshcomm's Backend protocol on a torch ProcessGroupGloo.

Buffers are handed to gloo as CPU tensors that view the NumPy memory
(``torch.from_numpy``), so no data is copied except where the contract needs a
fresh output (all-reduce is in place in gloo) or a dtype needs re-encoding
(:mod:`meshcomm_gloo.codecs`). Imports torch; imported only by the factory.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from meshcomm import algorithms
from meshcomm.backend import Backend
from meshcomm.errors import DistributedError

from .codecs import Plan, plan_for
from .errors import translate
from .liveness import Peer, suspects
from .rendezvous import make_group

__all__ = ["GlooBackend"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_TORCH = {name: getattr(torch, name) for name in
          ("int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")}
_P2P_TAG = 0


def _tensor(buf: np.ndarray, wire: np.dtype | None = None, torch_name: str | None = None) -> torch.Tensor:
    """A tensor sharing ``buf``'s memory, seen as ``wire`` (bytes by default)."""
    arr = buf.view(wire if wire is not None else np.uint8)
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:  # gloo only reads send buffers; silence torch's "not writable" warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    if torch_name is not None and t.dtype != _TORCH[torch_name]:
        t = t.view(_TORCH[torch_name])
    return t


class GlooBackend(Backend):
    """One meshcomm group = one ProcessGroupGloo; ``split`` makes a new one for each colour."""

    def __init__(self, pg: Any, store: Any, prefix: str, rank: int, size: int, timeout: float,
                 ifname: str | None = None, label: str = "world", peers: list[Peer] | None = None,
                 members: list[int] | None = None) -> None:
        self._pg = pg
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._size = size
        self._ifname = ifname
        self._label = label
        self._splits = 0
        self._children: list[weakref.ref[GlooBackend]] = []
        self._peers = peers or []
        self._members = members if members is not None else list(range(size))
        self.timeout = timeout

    # -- identity -------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"GlooBackend({self._label}, rank={self._rank}, size={self._size})"

    # -- plumbing -------------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self._rank} of the {self._label} group (size {self._size})"

    def _run(self, op: str, start: Callable[[], Any], peer: int | None = None) -> None:
        """Start a gloo work item and wait for it, translating failures."""
        if self._pg is None:
            raise DistributedError(f"[gloo] {self._where()}: {op} called after the group was closed")
        try:
            start().wait()
        except RuntimeError as exc:
            raise self._error(exc, op, peer) from exc

    def _error(self, exc: BaseException, op: str, peer: int | None) -> DistributedError:
        """Translate ``exc``, naming dead or stopped members of this host when gloo does not."""
        found: list[tuple[int, str]] = []
        if peer is None:
            for _ in range(10):  # a killed peer's socket may close just before it is reaped
                found = suspects(self._peers, self._members, self._rank)
                if found:
                    break
                time.sleep(0.05)
        return translate(exc, where=self._where(), op=op, timeout=self.timeout, peer=peer, suspects=found)

    # -- point-to-point -------------------------------------------------------------
    def send(self, buf: np.ndarray, dst: int) -> None:
        if buf.nbytes:
            t = _tensor(buf)
            self._run(f"send to rank {dst}", lambda: self._pg.send([t], dst, _P2P_TAG), peer=dst)

    def recv(self, buf: np.ndarray, src: int) -> None:
        if buf.nbytes:
            t = _tensor(buf)
            self._run(f"recv from rank {src}", lambda: self._pg.recv([t], src, _P2P_TAG), peer=src)

    def sendrecv(self, sendbuf: np.ndarray, dst: int, recvbuf: np.ndarray, src: int) -> None:
        """Both directions posted before waiting: gloo's send/recv are asynchronous."""
        if self._pg is None:
            raise DistributedError(f"[gloo] {self._where()}: sendrecv called after the group was closed")
        works = []
        try:
            if sendbuf.nbytes:
                works.append((self._pg.send([_tensor(sendbuf)], dst, _P2P_TAG), dst))
            if recvbuf.nbytes:
                works.append((self._pg.recv([_tensor(recvbuf)], src, _P2P_TAG), src))
            for w, _ in works:
                w.wait()
        except RuntimeError as exc:
            raise self._error(exc, f"sendrecv (to {dst}, from {src})", src if dst == src else None) from exc

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        plan = plan_for(sendbuf.dtype, op)
        if plan.generic:
            algorithms.all_reduce(self, sendbuf, recvbuf, op)
            return
        if plan.codec is None:  # reduce in place in the output, viewed as the wire dtype
            recvbuf[...] = sendbuf
            self._allreduce(_tensor(recvbuf, plan.wire, plan.torch), plan, op)
            return
        encode, decode = plan.codec
        wire = encode(sendbuf)
        self._allreduce(_tensor(wire, plan.wire, plan.torch), plan, op)
        decode(wire, recvbuf)

    def _allreduce(self, t: torch.Tensor, plan: Plan, op: str) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[plan.op]
        self._run(f"all_{op}", lambda: self._pg.allreduce([t], opts))

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """An all-reduce of a copy, then this rank's block.

        torch 2.13's gloo ``reduce_scatter_tensor`` works but measured 4-8x slower than its
        all-reduce of the whole buffer on 2-4 ranks (bench/bench_gloo.py notes), so the
        all-reduce, which moves at most twice the bytes, is the faster native path.
        """
        m = recvbuf.size
        full = np.empty(sendbuf.size, sendbuf.dtype)
        self.all_reduce(sendbuf, full, op)
        recvbuf[...] = full[self._rank * m : (self._rank + 1) * m]

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        src, out = _tensor(sendbuf), _tensor(recvbuf)
        self._run("all_gather", lambda: self._pg._allgather_base(out, src))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        t = _tensor(buf)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._run(f"broadcast from root {root}", lambda: self._pg.broadcast([t], opts),
                  peer=root if self._rank != root else None)

    def barrier(self) -> None:
        self._run("barrier", lambda: self._pg.barrier())

    # -- groups ---------------------------------------------------------------------
    def split(self, color: int, key: int) -> Backend:
        """A new ProcessGroupGloo for this colour, after every rank learnt every (colour, key)."""
        n, r = self._size, self._rank
        table = np.empty(2 * n, dtype=np.int64)
        self.all_gather(np.array([color, key], dtype=np.int64), table)
        colors, keys = table[0::2], table[1::2]
        members = [q for q in range(n) if colors[q] == color]
        members.sort(key=lambda q: (int(keys[q]) if keys[q] >= 0 else q, q))
        self._splits += 1  # same count on every rank: split is collective
        prefix = f"{self._prefix}/split{self._splits}/color{color}"
        label = f"split {self._splits} (color {color}) of the {self._label}"
        sub_rank, sub_size = members.index(r), len(members)
        try:
            pg = make_group(self._store, prefix, sub_rank, sub_size, self.timeout, self._ifname)
        except RuntimeError as exc:
            raise self._error(exc, f"split(color={color}) connecting to ranks {members}", None) from exc
        child = GlooBackend(pg, self._store, prefix, sub_rank, sub_size, self.timeout, self._ifname, label,
                            self._peers, [self._members[q] for q in members])
        self._children.append(weakref.ref(child))
        return child

    def close(self) -> None:
        """Drop this group's and its splits' process groups (gloo closes connections on free).

        Done at ``meshcomm.shutdown()`` (atexit) so that no ProcessGroupGloo is left for
        interpreter finalisation, where freeing one intermittently aborted the process.
        """
        for ref in self._children:
            child = ref()
            if child is not None:
                child.close()
        self._children.clear()
        self._pg = None
        self._store = None
