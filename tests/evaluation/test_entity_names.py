"""A partition's names kept compact: every name found at its offset (names packed into
their key and hashed ones, non-ASCII, the empty name), unknown ones not found, far fewer
bytes than Python strings in a dict, and the nearest names for suggestions."""

import random
import sys

from pbg_ray.evaluation.entity_names import PartitionNames


def mixed_names(n: int):
    """Short names (exact keys), long ones (hashed keys), non-ASCII and the empty name."""
    names = [f"u{i}" for i in range(n // 2)]
    names += [f"https://example.org/entity/{i}/ünïcode" for i in range(n // 2)] + [""]
    random.Random(0).shuffle(names)
    return names


def test_every_name_is_found_at_its_offset_and_unknown_ones_are_not():
    names = mixed_names(20_000)
    partition = PartitionNames(names)
    assert len(partition) == len(names)
    assert partition.offsets(names) == {name: i for i, name in enumerate(names)}
    assert partition.take([5, 0, 5]) == [names[5], names[0], names[5]]
    unknown = ["u10000", "https://example.org/entity/10000/ünïcode", "U1", " u1", "u1\x00"]
    assert partition.offsets(unknown) == {}
    assert partition.offsets(["u1", "nope"]) == {"u1": names.index("u1")}


def test_a_partition_keeps_its_names_in_a_fraction_of_a_python_dict():
    names = mixed_names(20_000)
    partition = PartitionNames(names)
    characters = sum(len(name.encode()) for name in names)
    as_python = sum(sys.getsizeof(name) for name in names) + sys.getsizeof(
        {name: i for i, name in enumerate(names)}) + sys.getsizeof(names)
    assert partition.nbytes <= characters + 20 * len(names)
    assert partition.nbytes < as_python / 3


def test_the_names_that_sort_next_to_an_unknown_one_are_suggested():
    partition = PartitionNames([f"user_{i}" for i in range(100_000)])
    near = partition.near("user_3015x")
    assert "user_30150" in near and "user_3015" in near
    assert len(near) <= 64
    assert partition.near("") == sorted(f"user_{i}" for i in range(100_000))[:32]
