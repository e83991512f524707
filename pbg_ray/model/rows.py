"""Random-row access to embedding tables: the C loops of `_rows.c` where they apply (CPU,
contiguous float32 tables, int64 ids), torch ops elsewhere (CUDA, an install built
without a C compiler, or PBG_RAY_C_KERNELS=0: see model.native)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from pbg_ray.model.native import c_ready, extension

_rows = extension("_rows")

BUILT = _rows is not None


def native(floats: Sequence[Tensor], longs: Sequence[Tensor]) -> bool:
    """Whether the C loops can serve these tensors: built, and all of them contiguous on the
    CPU, `floats` float32 and `longs` int64."""
    return BUILT and c_ready(floats, longs)


def gather_rows(table: Tensor, ids: Tensor, out: Tensor) -> Tensor:
    """out [n, D] = table[ids] (table [N, D], ids [n])."""
    if native((table, out), (ids,)):
        _rows.gather(table.data_ptr(), table.shape[0], table.shape[1], ids.data_ptr(),
                     ids.numel(), out.data_ptr())
        return out
    # index_select is far faster than table[ids].
    return torch.index_select(table, 0, ids, out=out)


def row_adagrad_(table: Tensor, sums: Tensor, ids: Tensor, grads: Tensor, lr: float,
                 owner: Tensor, known: int, known_scale: float) -> None:
    """The C loop of `optim.row_adagrad_` (when `native((table, sums, grads), (ids, owner))`)."""
    _rows.row_adagrad(table.data_ptr(), sums.data_ptr(), table.shape[0], table.shape[1],
                      ids.data_ptr(), grads.data_ptr(), ids.numel(), owner.data_ptr(),
                      lr, known, known_scale)


def adagrad_(param: Tensor, sums: Tensor, grad: Tensor, lr: float) -> None:
    """The C loop of `optim.adagrad_` without row scales (when `native((param, sums,
    grad), ())` and the three are the same size)."""
    _rows.adagrad(param.data_ptr(), sums.data_ptr(), grad.data_ptr(), param.numel(), lr)
