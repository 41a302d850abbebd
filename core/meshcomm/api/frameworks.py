"""Arrays of other frameworks (torch, MLX, JAX, anything with ``__dlpack__`` or the buffer
protocol) in, results of the caller's type out.

``mc.all_sum(torch_tensor)`` returns a tensor, ``mc.all_sum(mlx_array)`` an MLX array, as
code written for those frameworks expects. The input is read without a copy where the
framework shares its CPU memory (torch, JAX on the CPU, NumPy-compatible buffers); results
come back zero-copy for torch (``torch.from_numpy``) and as one copy for MLX and JAX, whose
arrays own their memory. Device memory (CUDA, Metal) is refused with the fix: meshcomm
moves host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .work import Work

__all__ = ["result_type", "to_numpy", "MappedWork"]

#: the top-level module of a framework's array type -> how to turn a NumPy result into one
_MAKERS: dict[str, Callable[[], Callable[[np.ndarray], Any]]] = {}


def _bf16() -> np.dtype:
    import ml_dtypes  # bfloat16 as NumPy sees it (meshcomm's own bfloat16 needs it too)

    return np.dtype(ml_dtypes.bfloat16)


def _torch() -> Callable[[np.ndarray], Any]:
    import torch

    def make(a: np.ndarray) -> Any:
        if not a.flags.writeable:  # torch warns on read-only memory: give it its own
            a = a.copy()
        if a.dtype.name == "bfloat16":  # torch.from_numpy knows no bfloat16: its bits as int16
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    return make


def _mlx() -> Callable[[np.ndarray], Any]:
    import mlx.core as mx

    def make(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return mx.array(a.view(np.int16)).view(mx.bfloat16)
        return mx.array(a)

    return make


def _jax() -> Callable[[np.ndarray], Any]:
    import jax.numpy as jnp

    return jnp.asarray


def _bfloat16_bits(x: Any) -> np.ndarray | None:
    """A torch or MLX bfloat16 array as NumPy (ml_dtypes' bfloat16), through its int16 bits:
    neither exports bfloat16 to NumPy directly."""
    if "bfloat16" not in str(getattr(x, "dtype", "")):
        return None
    root = type(x).__module__.partition(".")[0]
    if root == "torch":
        import torch

        return np.asarray(x.view(torch.int16)).view(_bf16())
    if root == "mlx":
        import mlx.core as mx

        return np.asarray(x.view(mx.int16)).view(_bf16())
    return None


_MAKERS.update(torch=_torch, mlx=_mlx, jax=_jax, jaxlib=_jax)


def result_type(x: Any) -> Callable[[np.ndarray], Any] | None:
    """How to give a result back in ``x``'s framework; None for NumPy, Python numbers and
    lists, and any array type meshcomm does not know (those get NumPy arrays)."""
    maker = _MAKERS.get(type(x).__module__.partition(".")[0])
    return None if maker is None else maker()


def to_numpy(x: Any, what: str = "x") -> np.ndarray:
    """``x`` as a NumPy array on the host, without a copy where its framework allows."""
    device = getattr(x, "device", None)
    if device is None or callable(device):
        kind = "cpu"  # NumPy-like buffers; MLX arrays live in memory the host can read
    else:
        kind = str(getattr(device, "type", None) or getattr(device, "platform", None) or device).lower()
    if not kind.startswith(("cpu", "tfrt_cpu")):
        raise ValueError(
            f"{what} is in {kind} memory; meshcomm moves host memory: pass {what}.cpu() (or copy it to the host first)"
        )
    if getattr(x, "requires_grad", False):
        raise ValueError(f"{what} requires grad; pass {what}.detach() (collectives are not differentiable here)")
    bits = _bfloat16_bits(x)
    if bits is not None:
        return bits
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError, ValueError):
            pass  # the buffer protocol or __array__ below
    return np.asarray(x)


class MappedWork(Work[Any]):
    """The handle of an asynchronous operation on a framework's array: ``wait()`` gives the
    result in that framework."""

    __slots__ = ("_inner", "_fn")

    def __init__(self, inner: Work[Any], fn: Callable[[np.ndarray], Any]) -> None:
        super().__init__(inner.op, inner.who)
        self._inner, self._fn = inner, fn

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait(self, timeout: float | None = None) -> Any:
        res = self._inner.wait(timeout)
        return res if res is None or not isinstance(res, np.ndarray) else self._fn(res)
