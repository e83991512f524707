"""What every Ray task of pbg_ray that reads partitions or runs the kernel shares: its
worker's environment and threads; and the results of tasks and the end of actors, with the
project's errors (a worker that died on every try of its task among them) and nothing left
going on behind a failure."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, List, Optional

import ray
from ray.exceptions import ActorDiedError, OutOfMemoryError, RayTaskError, WorkerCrashedError

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, in_chain
from pbg_ray.model.native import KERNEL_ENV

# Every task that reads partitions or runs the kernel (train, eval, export, predict) starts
# in one kind of worker, with the kernel's malloc settings (glibc reads them at start). Ray
# keeps an idle pool per runtime_env, at most a worker per CPU in all: tasks of a second
# kind would push these workers out, and each new worker imports torch again.
TASK_RUNTIME_ENV = {"env_vars": KERNEL_ENV}
# How often a task whose worker died is run again before the run stops: Ray's default for
# tasks, which, on the local Ray pbg_ray starts, tasks that Ray's memory monitor killed are
# given too (theirs: without end).
TASK_RETRIES = 3
# How long a failed run waits for the tasks it stopped (or the other returns of a failed
# task) to finish, so that none writes after the caller cleaned up.
CANCEL_WAIT_S = 60.0
# How often stop_actors asks the GCS whether an actor it killed is dead yet.
ACTOR_DEATH_POLL_S = 0.002


def task_threads(config: ConfigSchema) -> int:
    """The torch and BLAS threads of a task that asks for ray.cpus_per_trainer CPUs."""
    return max(1, int(config.ray.task_cpus()))


def on_task_threads(task: Callable[..., Any]) -> Callable[..., Any]:
    """`task(config, ...)` run on task_threads(config) torch and BLAS threads. A worker
    process keeps the thread counts that its last task set, and the rounding of scores
    follows them (which decides a tie between a positive and a negative of the same
    entity): each task sets its own, so that its results depend on its config alone,
    not on what its worker ran before."""

    @functools.wraps(task)
    def run(config: ConfigSchema, *args: Any, **kwargs: Any) -> Any:
        from pbg_ray.model.blas import cpu_threads

        with cpu_threads(task_threads(config)):
            return task(config, *args, **kwargs)
    return run


def get_results(refs: Any, wait_all: bool = False) -> Any:
    """ray.get, re-raising a task's PbgRayError as itself (one clear line for the user).
    When one of a list of tasks failed, the others are waited for and their results
    dropped first (see discard): none is left going on, nor reported again by Ray.
    `wait_all`: wait for every one to end before reading any (tasks and actor calls that
    write files: none goes on behind the error, where the next run could meet it)."""
    if wait_all:
        ray.wait(refs, num_returns=len(refs))
    try:
        return ray.get(refs)
    except Exception as err:
        if isinstance(refs, list):
            discard(refs)
        if isinstance(err, RayTaskError) and isinstance(err.cause, PbgRayError):
            raise err.cause from None
        raise


def worker_died(err: BaseException) -> Optional[PbgRayError]:
    """One line for a run stopped because a task's worker died on every try, or an
    actor's worker died (`err` is, or was raised from, Ray's WorkerCrashedError, its
    memory monitor's OutOfMemoryError or ActorDiedError), saying what most often ends a
    worker and how to fix that; None for other errors."""
    died = in_chain(err, (WorkerCrashedError, OutOfMemoryError, ActorDiedError))
    if died is None:
        return None
    ray_says = str(died).strip().split("\n")[0].split(". ")[0].rstrip(".")
    if isinstance(died, ActorDiedError):
        what = "a Ray actor's worker died"
    else:
        what = "a Ray task's worker died on each of its tries" if died is err else str(err)
    return PbgRayError(
        f"{what} (Ray: {ray_says}). A worker that outgrows the memory of its node is ended "
        "by the kernel's OOM killer or Ray's memory monitor (Ray's lines above say which): "
        "give the run more memory, or run fewer tasks at once (ray.num_cpus).")


def discard(refs: List[ray.ObjectRef], timeout: Optional[float] = CANCEL_WAIT_S) -> None:
    """Wait up to `timeout` (None: as long as they take) for `refs`, then read and drop
    their results, which nobody will use: Ray would log a traceback ("Unhandled error")
    for each failed one once its refs are gone (after a failed run, beside the one error
    the user already got). All the returns of a failed task are waited for, as they
    reach the driver one after another."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001  the error that counts was raised already
            pass


def stop_actors(actors: List[ray.actor.ActorHandle], timeout: float = CANCEL_WAIT_S) -> None:
    """End `actors` at once and forget them: ray.kill ends each process without its
    teardown, and the handles go only once the GCS has each actor dead (or `timeout`
    passed). An actor whose handles are all gone gets Ray's graceful exit instead, which
    runs Ray's and Python's teardown in its process, and a handle dropped before its kill
    reached the GCS can have that exit win. A teardown that hangs leaves the process
    running for good: Ray's check that ends a worker whose raylet died stops as the exit
    begins."""
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor)
        deadline = time.monotonic() + timeout
        for actor in actors:
            while (time.monotonic() < deadline and ray._private.state.actors(
                    actor._ray_actor_id.hex()).get("State") != "DEAD"):
                time.sleep(ACTOR_DEATH_POLL_S)
    actors.clear()
