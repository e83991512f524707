"""What the trainer does when a process it depends on dies: which failures are the
machinery's (a process or node died, not the work), and how often one piece of work may
be lost to them before the run stops (as Ray Train's FailurePolicy decides for a run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable

from ray.exceptions import NodeDiedError, ObjectLostError, WorkerCrashedError

# A bucket's train task lost with its process or node (its bucket is handed out again).
TRAINER_DIED = (WorkerCrashedError, NodeDiedError, ObjectLostError)


@dataclass
class FailurePolicy:
    """Counts failures per piece of work (a bucket in a pass, a pass): the work is done
    again until it has failed `max_failures` times, and then the run stops naming it."""

    max_failures: int = 3
    failures: Dict[Hashable, int] = field(default_factory=dict)

    def retry(self, work: Hashable, what: str, err: BaseException) -> None:
        """Count a failure of `work`; RuntimeError (from `err`) once it has failed
        max_failures times. `what`: who died doing the work, and where, for the message."""
        count = self.failures[work] = self.failures.get(work, 0) + 1
        if count >= self.max_failures:
            raise RuntimeError(f"{what} died {count} times; giving up") from err
