"""Per-partition jobs of the commands that read a whole table (export, predict): a
`MapPartitions` runs a function over jobs and yields the results in the jobs' order.
`in_process` runs them here, one after another; runtime/partition_jobs.py runs them as
Ray tasks that read their partitions themselves."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, Tuple

# Runs fn(*job) for each job and yields the results in the jobs' order. Functions and
# jobs are picklable, so that a job can run in another process.
MapPartitions = Callable[[Callable[..., Any], Sequence[Tuple[Any, ...]]], Iterator[Any]]


def in_process(fn: Callable[..., Any], jobs: Sequence[Tuple[Any, ...]]) -> Iterator[Any]:
    """A MapPartitions running the jobs one after another in this process."""
    return (fn(*job) for job in jobs)
