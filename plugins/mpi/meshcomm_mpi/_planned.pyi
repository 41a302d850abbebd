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
    ) -> None: ...
    def run(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool: ...
