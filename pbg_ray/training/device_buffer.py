"""A device-step trainer's partitions on its device between its tasks: the worker's
PartitionBuffer one level up.

Each partition it holds is a version: the driver names the value a task receives
(BucketWork.versions) and the value its result will be once applied (BucketWork.results),
a new name for every task it submits, so a task that failed leaves nothing a later one
could take for current. A bucket copies to the device only the partitions it lacks at
their version; after training they are held at their results' versions. They come back
to the host only when they must: at once where the task returns values (memory placement,
deltas, a held-out evaluation), else (a swap file of disk placement) when the worker's
PartitionBuffer writes the file (behind the task, or when it drops a partition it held
unwritten: the checkpoint at the pass's end is one such write), or when this buffer drops
the partition to make room. A table that fits crosses to the device once a run.

The next bucket's partitions that a task reads ahead (disk placement) are copied on a
second stream as soon as they are read, while the current bucket trains.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import PartitionKey

if TYPE_CHECKING:  # the driver imports this module (bucket_task's) without torch
    import torch
    from torch import Tensor

Arrays = Tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass
class _Held:
    """A partition on the device: embeddings [N + 1, D] and sums [N + 1] (a spare row
    last, see DeviceTables), at `version`; `dirty`: the host arrays it must be copied into
    before they are written (None: they hold its values); `ready`: its copy to the device,
    on the second stream, where one is in flight."""

    version: Optional[str]
    embeddings: "Tensor"
    sums: "Tensor"
    dirty: Optional[Arrays] = None
    ready: Any = None  # a torch.cuda.Event

    @property
    def nbytes(self) -> int:
        return self.embeddings.nbytes + self.sums.nbytes


class DeviceBuffer:
    """The partitions a worker keeps on its device (module docstring). Ray ships it by
    value to each worker as an empty buffer of its own (as PartitionBuffer)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the writer, hand-over and reader threads copy too
        self.held: "collections.OrderedDict[PartitionKey, _Held]" = collections.OrderedDict()
        self.device: Optional["torch.device"] = None
        self.stream: Any = None  # the second stream (a torch.cuda.Stream; None on the CPU)
        self.bytes_to_device = 0
        self.bytes_from_device = 0
        self.copies_to_device = 0
        self.copies_from_device = 0
        self.reported = (0, 0, 0, 0)

    def __reduce__(self):
        return DeviceBuffer, ()

    def start(self, device: "torch.device") -> None:
        """Hold partitions on `device` (dropping those held elsewhere)."""
        import torch
        if self.device != device:
            self.held.clear()
            self.device = device
            self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # --- a task's partitions -------------------------------------------------

    def partitions(self, keys: Sequence[PartitionKey], versions: Sequence[Optional[str]],
                   arrays: Dict[PartitionKey, Arrays]
                   ) -> Dict[PartitionKey, Tuple["Tensor", "Tensor"]]:
        """The bucket's partitions on the device: those held at their version as they are,
        the others copied from `arrays`."""
        import torch
        out = {}
        with self.lock:
            for key, version in zip(keys, versions):
                held = self.held.get(key)
                if held is None or version is None or held.version != version:
                    held = self._copy_in(key, version, arrays[key], stream=None)
                elif held.ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(held.ready)
                    held.ready = None
                self.held.move_to_end(key)
                out[key] = (held.embeddings, held.sums)
        return out

    def ahead(self, key: PartitionKey, version: Optional[str], arrays: Arrays) -> None:
        """Copy a partition the trainer's next bucket will need, read ahead, on the second
        stream (unless held at that version already)."""
        if version is None:
            return
        with self.lock:
            held = self.held.get(key)
            if held is None or held.version != version:
                self._copy_in(key, version, arrays, stream=self.stream)

    def _copy_in(self, key: PartitionKey, version: Optional[str], arrays: Arrays,
                 stream: Any) -> _Held:
        """Hold `arrays` (host) at `version` on the device: a copy (on `stream`, if not
        None), into the tensors the key had where their size fits."""
        import torch
        embs, sums = arrays
        old = self.held.pop(key, None)
        if old is not None:
            _settle(old)
            if old.dirty is not None:
                self._copy_out(old)
        rows = len(embs) + 1
        if old is not None and old.embeddings.shape == (rows, embs.shape[1]):
            target_e, target_s = old.embeddings, old.sums
        else:
            target_e = torch.empty(rows, embs.shape[1], dtype=torch.float32, device=self.device)
            target_s = torch.zeros(rows, dtype=torch.float32, device=self.device)
        ready = None
        if stream is not None:
            with torch.cuda.stream(stream):
                target_e[:-1].copy_(torch.from_numpy(embs), non_blocking=True)
                target_s[:-1].copy_(torch.from_numpy(sums), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
        else:
            target_e[:-1].copy_(torch.from_numpy(embs))
            target_s[:-1].copy_(torch.from_numpy(sums))
        self.bytes_to_device += embs.nbytes + sums.nbytes
        self.copies_to_device += 1
        held = _Held(version, target_e, target_s, ready=ready)
        self.held[key] = held
        return held

    def trained(self, keys: Sequence[PartitionKey], results: Sequence[Optional[str]],
                arrays: Dict[PartitionKey, Arrays], now: Sequence[bool]) -> None:
        """After the bucket: each partition held at its result's version, and copied into
        its host `arrays` where `now` says so (else once they are written: copy_back)."""
        with self.lock:
            for key, version, at_once in zip(keys, results, now):
                held = self.held[key]
                held.version = version
                held.dirty = arrays[key]
                if at_once:
                    self._copy_out(held)

    def copy_back(self, arrays: Arrays) -> None:
        """Before host `arrays` are written: the device's newer values of the partition
        they hold, if any, copied into them."""
        with self.lock:
            for held in self.held.values():
                if held.dirty is not None and held.dirty[0] is arrays[0]:
                    self._copy_out(held)

    def _copy_out(self, held: _Held) -> None:
        import torch
        embs, sums = held.dirty
        torch.from_numpy(embs).copy_(held.embeddings[:-1])
        torch.from_numpy(sums).copy_(held.sums[:-1])
        self.bytes_from_device += embs.nbytes + sums.nbytes
        self.copies_from_device += 1
        held.dirty = None

    # --- room --------------------------------------------------------------

    def keep(self, capacity: Optional[int], order: Iterable[PartitionKey]) -> None:
        """Drop partitions beyond `capacity` (None: no limit), those not in `order` (the
        partitions the trainer needs next, soonest first) first, then the latest there;
        each copied back first where the device holds its newest values."""
        if capacity is None:
            return
        with self.lock:
            rank = {key: i for i, key in enumerate(order)}
            by_need = sorted(self.held, key=lambda k: rank.get(k, len(rank)))
            for key in by_need[capacity:]:
                held = self.held.pop(key)
                _settle(held)
                if held.dirty is not None:
                    self._copy_out(held)

    def take_io(self) -> Dict[str, int]:
        """Copies and bytes to and from the device since the last call."""
        now = (self.copies_to_device, self.bytes_to_device, self.copies_from_device,
               self.bytes_from_device)
        before, self.reported = self.reported, now
        names = ("copies_to_device", "bytes_to_device", "copies_from_device", "bytes_from_device")
        return {n: a - b for n, a, b in zip(names, now, before)}


def _settle(held: _Held) -> None:
    """Wait for a copy to the device still going on into `held` (before its memory is
    written or given back)."""
    if held.ready is not None:
        held.ready.synchronize()
        held.ready = None


def capacity(config: ConfigSchema, device: "torch.device", partition_bytes: int
             ) -> Optional[int]:
    """Partitions the buffer keeps: ray.device_buffer, or as many as fit in half a GPU's
    memory (None: no limit, on the CPU)."""
    import torch
    if config.ray.device_buffer is not None:
        return config.ray.device_buffer
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(2, int(total // 2 // max(1, partition_bytes)))


def keys_by_next_use(config: ConfigSchema, next_use: Sequence[int],
                     current: Sequence[PartitionKey]) -> List[PartitionKey]:
    """The partitions a trainer needs next, soonest first: the current bucket's, then those
    of the partition indices in `next_use` (of every partitioned type)."""
    partitioned = [e for e, c in config.entities.items() if c.num_partitions > 1]
    order = list(current)
    for part in next_use:
        order += [(e, part) for e in partitioned if (e, part) not in order]
    return order
