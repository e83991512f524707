"""The `ray` section of the config: where and how the work runs. None of it changes the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pbg_ray.config.options import Bounds, not_negative, one_of, option, positive

PLACEMENTS = ("memory", "disk")


@dataclass
class RayConfig:
    """Where and how the work runs. None of this changes the model."""

    address: Optional[str] = option(None, help=
        'null starts a local Ray (or joins RAY_ADDRESS, which `ray job submit` sets); "auto" '
        "joins the cluster `ray up` started.")
    num_cpus: Optional[int] = option(None, check=positive, help=
        "CPUs of a local Ray started by pbg_ray (null: all of the machine's).")
    object_store_memory: Optional[int] = option(None, help=
        "Bytes of object store for a local Ray (null: 30% of the memory budget where that "
        "is smaller than the machine, else Ray's default).")
    memory_budget: Optional[int] = option(None, check=positive, help=
        "Bytes a run on a local Ray may use (null: the limit of the memory cgroup it runs "
        "in, a container's or a job's, else the machine's RAM). Training checks its plan "
        "against it before it starts: a memory-placement run that cannot fit is refused "
        "with the figures and the fix, and disk placement sizes its partition buffer to "
        "fit (ray.partition_buffer; docs/sizing.md).")
    num_trainers: Optional[int] = option(None, check=positive, help=
        "Train tasks running at once (null: as many as the CPUs allow, and no more than the "
        "partition count: an unpartitioned graph trains one bucket a pass, so one task). Each "
        "runs in a worker process of its own, which loads torch: on a small machine, one "
        "task of all its CPUs (num_trainers=1, cpus_per_trainer null) holds less memory "
        "(docs/benchmarks.md, the fixed footprint).")
    cpus_per_trainer: Optional[float] = option(None, check=positive.with_fix(
        "Ask for at least a fraction of a CPU per train task, or null for the CPUs the "
        "partitions leave."), help=
        "CPUs each train task asks Ray for; it trains on int(cpus_per_trainer) Hogwild "
        "threads. null: the CPUs there are, shared by the train tasks the partitions let run "
        "at once (an unpartitioned graph, one bucket at a time: all of a node's CPUs; as "
        "many partitions as CPUs: 1 each; 1 for the device step, GPU training or "
        "ray.device_step, and in a Ray Tune trial), stated in the run's first lines; eval, predict and export tasks take 1. A value set "
        "is taken as it is (1 with ray.num_trainers=1: a reproducible run), with a warning "
        "where the partitions leave CPUs idle. More than any node has is refused on a local "
        "Ray that pbg_ray starts (nothing would add a larger node) and a warning on a "
        "cluster, whose autoscaler may.")
    gpus_per_trainer: float = option(0.0, check=not_negative.with_fix(
        "Use 0 for CPU training."), help=
        "GPUs each train task asks Ray for (0: CPU training). A task on a GPU trains its "
        "bucket with the device step: the bucket's rows, parameters, negatives and stats "
        "stay on the GPU for the bucket's life (docs/architecture.md).")
    device_step: bool = option(False, help=
        "Train tasks on CPUs run the device step (the GPU's, on one thread a task) instead "
        "of the CPU kernel: the GPU path checked where no GPU is. Tasks on GPUs always run it.")
    cuda_graphs: bool = option(False, help=
        "Train tasks on GPUs run each group of 64 full batches of a bucket of one relation (or "
        "of dynamic relations) as one captured CUDA graph, one launch for the group's "
        "kernels; kernel_bench --cuda-graphs measures it against launching them one by "
        "one (docs/benchmarks.md, the GPU path).")
    device_buffer: Optional[int] = option(None, check=Bounds(
        "must be at least 2", "A bucket needs its two partitions on the device at once; use "
        "2 or more, or null.", low=2), help=
        "Partitions each device-step trainer keeps on its device between buckets (at least "
        "2): a bucket copies to the device only those it lacks, and back only what a "
        "checkpoint, a swap file or an eviction needs. null: as many as fit in half the "
        "GPU's memory, so a table that fits crosses to it once a run (on the CPU: all).")
    placement: str = option("memory", check=one_of(PLACEMENTS), help=
        '"memory": partitions live in partition-store actors spread over the cluster; "disk": '
        "partitions are swapped to checkpoint storage, so one machine trains tables larger "
        "than its RAM.")
    partition_buffer: Optional[int] = option(None, check=Bounds(
        "must be at least 2", "A bucket needs its two partitions in memory at once; use 2 or "
        "more, or null to fit the memory budget.", low=2), help=
        "Disk placement: partitions each trainer keeps in memory between its buckets "
        "(at least 2, the two of a bucket); a bucket finds the partitions it shares with "
        "the trainer's recent ones there instead of reading them again. Besides these it "
        "holds the next bucket's partitions, read while the current one trains, and the "
        "last bucket's while they are written, so a trainer's memory is about "
        "partition_buffer + 4 partitions. null: on a local Ray, the most partitions that "
        "fit ray.memory_budget, up to the partition count; joining a cluster, 2. "
        "bucket_order=beta orders buckets for this buffer, with the fewest reads.")
    num_partition_stores: Optional[int] = option(None, check=positive, help=
        "Partition-store actors (null: one per node, at most one per partition).")

    def task_cpus(self) -> float:
        """CPUs of a task of the train tasks' kind: cpus_per_trainer, 1 where it is null (a
        training run sets it before its first task: Trainer.cpus_per_trainer)."""
        return self.cpus_per_trainer or 1.0
