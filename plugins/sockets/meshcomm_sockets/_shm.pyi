from typing import Any

class Channel:
    def __init__(self, segment: Any, ranks: int, me: int, line: int, piece: int) -> None: ...
    def publish(
        self, src: Any, d: int, op: int, dtype: int, total: int, cseq: int, arg: int, seq: int, prev: int
    ) -> int: ...
    def spin(self, prev: int, budget_ns: int, yielding: bool) -> bool: ...
    def matches(self, d: int, op: int, dtype: int, total: int, cseq: int, arg: int) -> bool: ...
    def all_sum(
        self,
        src: Any,
        out: Any,
        kind: int,
        d: int,
        op: int,
        dtype: int,
        total: int,
        cseq: int,
        arg: int,
        seq: int,
        prev: int,
        budget_ns: int,
        yielding: bool,
    ) -> int: ...
    def read_sum(
        self, out: Any, own: Any, kind: int, where: Any, chunk: int, copies: Any = ...
    ) -> tuple[int, int] | None: ...
    def release(self) -> None: ...

class QuickSum:
    def __init__(
        self,
        channel: Channel,
        group: Any,
        owner: Any,
        fabric: Any,
        codes: dict[Any, tuple[int, int]],
        split_min: int,
        seq_mask: int,
        seq_wrap: int,
        count_mask: int,
        shape_shift: int,
        op: int,
        desc_at0: int,
        desc_at1: int,
    ) -> None: ...
    def run(self, sendbuf: Any, recvbuf: Any) -> bool: ...
