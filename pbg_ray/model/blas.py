"""Batched matrix products of the kernel, through numpy's BLAS on the CPU.

torch's CPU wheels carry MKL, which keeps to its AVX2 code on AMD processors; numpy's
wheels carry OpenBLAS, which picks its kernels by the CPU's features. On an AVX-512 AMD
EPYC, on the kernel's shapes ([20, 50, 100] x [20, 100, 150] and the backward's
transposes), OpenBLAS's AVX-512 kernels are well ahead of torch.bmm's AVX2 ones;
elsewhere they are about even. numpy's matmul takes transposed views as they are
(BLAS's trans flags) and releases the GIL, so Hogwild threads overlap in it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from torch import Tensor


def bmm(a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """a [n, P, K] @ b [n, K, N] -> [n, P, N], written into `out` when given (of that
    shape). Either operand may be a transposed view."""
    if a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 \
            and not (a.requires_grad or b.requires_grad):
        if out is None:
            out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
        np.matmul(a.numpy(), b.numpy(), out=out.numpy())
        return out
    return torch.bmm(a, b, out=out)


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
