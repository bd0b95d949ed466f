"""The cuda-bindings result convention, for the fake's scripts (``ctl.py``, ``target.py``).

A binding returns ``(CUresult, *values)`` or a bare ``CUresult``; ``check`` raises
``CudaError`` naming the error, or returns the value(s).
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu


class CudaError(Exception):
    """A driver call failed; the message is the CUresult's name (``CUDA_ERROR_...``)."""


def check(result: Any) -> Any:
    """The value(s) of a successful call: None, one value, or a tuple of them."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(cu.CUresult(err).name)
    return values[0] if len(values) == 1 else tuple(values) if values else None
