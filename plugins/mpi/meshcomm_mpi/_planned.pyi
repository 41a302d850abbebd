from typing import Any

import numpy as np

class PlannedSum:
    def __init__(
        self,
        backend: Any,
        control: Any,
        start: int,
        test: int,
        iprobe: int,
        ctl: int,
        ctl_size: int,
        any_source: int,
        any_tag: int,
        oversubscribed: bool,
        spin: float,
        max_bytes: int,
        carried_data: int = 0,
        codes: dict[np.dtype, int] | None = None,
    ) -> None: ...
    def run(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool: ...
    def barrier(self) -> bool: ...

CARRIED_HEAD: int
CARRIED_DATA: int
CARRIED_CODES: dict[str, int]

def carried_op(op_create: int, op_size: int) -> int: ...
