"""NumPy buffers as the CPU tensors gloo reads and writes, sharing their memory."""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["tensor"]

_TORCH = {
    name: getattr(torch, name)
    for name in ("int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
}


def tensor(buf: np.ndarray, wire: np.dtype | None = None, torch_name: str | None = None) -> torch.Tensor:
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
