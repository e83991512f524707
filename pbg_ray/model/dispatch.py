"""A count of what a piece of torch code asks of its device: the aten operations it
dispatches (each a kernel launch on a GPU; views left out, as they launch nothing) and its
host reads (a value read back to Python, each a synchronisation on a GPU)."""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations whose result the host must see: a scalar read (.item(), bool(), int(), a Python
# branch on a tensor's value), or an output whose size depends on the values.
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::unique",
                 "aten::_unique", "aten::masked_select", "aten::equal", "aten::is_nonzero")


class DispatchCount(TorchDispatchMode):
    """Within its `with`: `ops`, the non-view aten operations by name, and `host_reads`,
    the host reads by name (the ops above, and Tensor.tolist / numpy / item, which a CPU
    tensor serves without dispatching anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(HOST_READ_OPS):
            self.host_reads[name] += 1
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_host_reads(self) -> int:
        return sum(self.host_reads.values())

    @contextlib.contextmanager
    def watching_reads(self) -> Iterator["DispatchCount"]:
        """The mode, with Tensor.tolist / numpy / item counted as host reads too."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "item")}

        def counted(name):
            def read(tensor, *args, **kwargs):
                self.host_reads[f"Tensor.{name}"] += 1
                return originals[name](tensor, *args, **kwargs)
            return read

        try:
            for name in originals:
                setattr(torch.Tensor, name, counted(name))
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
