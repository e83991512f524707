"""Batched matrix products of the kernel, through numpy's BLAS on the CPU.

torch's CPU wheels carry MKL, which keeps to its AVX2 code on AMD processors; numpy's
wheels carry OpenBLAS, which picks its kernels by the CPU's features. On an AVX-512 AMD
EPYC, on the kernel's shapes ([20, 50, 100] x [20, 100, 150] and the backward's
transposes), OpenBLAS's AVX-512 kernels are well ahead of torch.bmm's AVX2 ones;
elsewhere they are about even. numpy's matmul takes transposed views as they are
(BLAS's trans flags) and releases the GIL, so Hogwild threads overlap in it.

A score block Q K^T (Q [n, P, D], K [n, N, D]) has a transposed operand, and OpenBLAS
runs that form well below the others on the kernel's shapes: on AVX-512 it packs K first,
at about 60% of the rate of the untransposed form. The kernel lays its score blocks out
[n, N, P] in memory (a transposed view [n, P, N]); into such an `out`, bmm computes the
block's transpose, K Q^T, with Q^T copied contiguous first (Q is the smaller operand), so
BLAS runs its fastest form (docs/benchmarks.md, "The CPU kernel").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch
from threadpoolctl import threadpool_info, threadpool_limits
from torch import Tensor


class _Scratch(threading.local):
    """Per-thread arrays for transposed copies, kept from call to call by shape."""

    def __init__(self) -> None:
        self.arrays: Dict[Tuple[int, ...], np.ndarray] = {}

    def transposed(self, a: np.ndarray) -> np.ndarray:
        """a [n, P, K] copied as a contiguous [n, K, P]."""
        shape = (a.shape[0], a.shape[2], a.shape[1])
        buf = self.arrays.get(shape)
        if buf is None:
            buf = self.arrays[shape] = np.empty(shape, np.float32)
        np.copyto(buf, a.transpose(0, 2, 1))
        return buf


_SCRATCH = _Scratch()


def bmm(a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """a [n, P, K] @ b [n, K, N] -> [n, P, N], written into `out` when given (of that
    shape). Either operand may be a transposed view, and so may `out`: then its transpose
    b^T a^T is computed, a^T copied contiguous."""
    if a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 \
            and not (a.requires_grad or b.requires_grad):
        if out is None:
            out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
        if out.stride(1) == 1 and out.stride(2) != 1:
            np.matmul(b.numpy().transpose(0, 2, 1), _SCRATCH.transposed(a.numpy()),
                      out=out.numpy().transpose(0, 2, 1))
        else:
            np.matmul(a.numpy(), b.numpy(), out=out.numpy())
        return out
    return torch.bmm(a, b, out=out)


@functools.lru_cache(maxsize=None)
def sgemm_address() -> Optional[int]:
    """The address of cblas_sgemm in numpy's OpenBLAS where that is an ILP64 build (64-bit
    sizes, as numpy's wheels ship it), for C loops that run their products chunk by chunk
    (_loss.c); None where numpy has another BLAS (Accelerate, MKL): the callers then keep
    to numpy's matmul."""
    for info in threadpool_info():
        if info.get("internal_api") != "openblas":
            continue
        library = ctypes.CDLL(info["filepath"])  # already loaded: the same handle
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):
            function = getattr(library, name, None)
            if function is not None:
                return ctypes.cast(function, ctypes.c_void_p).value
    return None


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads and numpy's BLAS threads set to n, then restored (Hogwild
    workers run one thread each: a BLAS call of many threads per worker oversubscribes
    the cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(old)
