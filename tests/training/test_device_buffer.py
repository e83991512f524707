"""A device-step worker's DeviceBuffer, on the CPU: the copies to the device and back that a
bucket order costs (the copy plan), the values they carry, and a version it does not hold
copied in again."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.training.device_buffer import DeviceBuffer, keys_by_next_use
from pbg_ray.training.scheduler import parts_by_next_use
from pbg_ray.types import Bucket
from tests.util import config_dict

ORDER = [Bucket(0, 0), Bucket(0, 1), Bucket(1, 1), Bucket(1, 0), Bucket(2, 0), Bucket(2, 1),
         Bucket(2, 2), Bucket(0, 2), Bucket(1, 2)]


def one_type(tmp_path) -> ConfigSchema:
    return ConfigSchema.from_dict(config_dict(
        tmp_path, entities={"node": {"num_partitions": 3}},
        relations=[{"name": "r", "lhs": "node", "rhs": "node"}]))


class Worker:
    """One trainer's worker: its DeviceBuffer, the host arrays of each partition, and each
    partition's version as the driver names them."""

    def __init__(self, config: ConfigSchema, capacity: Optional[int]) -> None:
        self.config, self.capacity = config, capacity
        self.buffer = DeviceBuffer()
        self.buffer.start(torch.device("cpu"))
        self.arrays = {("node", p): (np.full((4 + p, 3), float(p), np.float32),
                                     np.zeros(4 + p, np.float32)) for p in range(3)}
        self.versions: Dict[Tuple[str, int], Optional[str]] = {}
        self.trained = 0

    def train_pass(self, order: List[Bucket]) -> List[Tuple[int, int]]:
        """Each bucket of `order` as a disk-placement task trains it (its partitions copied
        back when written: here at the pass's end), then the pass's end: (copies to the
        device, copies back) per bucket, the pass's end last."""
        copies = []
        for i, bucket in enumerate(order):
            keys = list(dict.fromkeys([("node", bucket.lhs), ("node", bucket.rhs)]))
            held = self.buffer.partitions(keys, [self.versions.get(k) for k in keys], self.arrays)
            for embs, _ in held.values():  # the bucket's training
                embs[:-1] += 1
            self.trained += 1
            results = [f"{k}@{self.trained}" for k in keys]
            self.buffer.trained(keys, results, self.arrays, now=[False] * len(keys))
            self.versions.update(zip(keys, results))
            self.buffer.keep(self.capacity, keys_by_next_use(
                self.config, parts_by_next_use(order[i + 1:]), keys))
            io = self.buffer.take_io()
            copies.append((io["copies_to_device"], io["copies_from_device"]))
        for embs, sums in self.arrays.values():  # the checkpoint writes every partition
            self.buffer.copy_back((embs, sums))
        io = self.buffer.take_io()
        copies.append((io["copies_to_device"], io["copies_from_device"]))
        return copies


def test_a_table_that_fits_crosses_to_the_device_once(tmp_path):
    worker = Worker(one_type(tmp_path), capacity=None)
    first, second = worker.train_pass(ORDER), worker.train_pass(ORDER)
    assert sum(c[0] for c in first) == 3 and sum(c[0] for c in second) == 0
    # Back only at each pass's end, for the checkpoint: each partition once.
    assert [c[1] for c in first] == [0] * 9 + [3] and [c[1] for c in second] == [0] * 9 + [3]


def test_the_copy_plan_of_a_buffer_of_two(tmp_path):
    worker = Worker(one_type(tmp_path), capacity=2)
    # In: a partition the bucket lacks. Back: the partition needed last, to make room (at
    # buckets 5, 6, 8 and 9), then the two held at the pass's end.
    assert worker.train_pass(ORDER) == [(1, 0), (1, 0), (0, 0), (0, 0), (1, 1), (1, 1),
                                        (0, 0), (1, 1), (1, 1), (0, 2)]


def test_the_values_come_back_and_a_version_it_lacks_comes_in(tmp_path):
    worker = Worker(one_type(tmp_path), capacity=None)
    worker.train_pass(ORDER)  # every partition trained in 5 buckets: + 5
    for p in range(3):
        np.testing.assert_array_equal(worker.arrays[("node", p)][0], p + 5.0)
    # Another worker trained partition 0 (a version this one never held): copied in again,
    # and this buffer's newer values of it copied back before being replaced.
    key = ("node", 0)
    held = worker.buffer.partitions([key], [worker.versions[key]], worker.arrays)
    held[key][0][:-1] += 1
    worker.buffer.trained([key], ["mine"], worker.arrays, now=[False])
    elsewhere = (np.full((4, 3), 7.0, np.float32), np.zeros(4, np.float32))
    theirs = worker.buffer.partitions([key], ["theirs"], {key: elsewhere})
    np.testing.assert_array_equal(worker.arrays[key][0], 6.0)
    np.testing.assert_array_equal(theirs[key][0][:-1].numpy(), 7.0)
    assert worker.buffer.take_io()["copies_to_device"] == 1
