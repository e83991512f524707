"""The failure policy: a piece of work is done again until it has failed max_failures
times, counted per piece."""

import pytest
from ray.exceptions import WorkerCrashedError

from pbg_ray.cli import user_error
from pbg_ray.training.failures import FailurePolicy


def test_work_is_retried_until_it_failed_max_failures_times():
    policy = FailurePolicy(max_failures=3)
    cause = ConnectionError("node lost")
    policy.retry("bucket (0, 1)", "the trainer of bucket (0, 1)", cause)
    policy.retry("bucket (1, 0)", "the trainer of bucket (1, 0)", cause)  # another piece
    policy.retry("bucket (0, 1)", "the trainer of bucket (0, 1)", cause)
    with pytest.raises(RuntimeError, match=r"^the trainer of bucket \(0, 1\) died 3 times; "
                                           r"giving up$") as raised:
        policy.retry("bucket (0, 1)", "the trainer of bucket (0, 1)", cause)
    assert raised.value.__cause__ is cause
    assert policy.failures == {"bucket (0, 1)": 3, "bucket (1, 0)": 1}


def test_a_trainer_whose_worker_died_each_time_stops_the_command_in_one_line():
    policy = FailurePolicy(max_failures=1)
    with pytest.raises(RuntimeError) as raised:
        policy.retry("bucket (0, 1)", "the trainer of bucket (0, 1)", WorkerCrashedError())
    message = str(user_error(raised.value))
    assert message.startswith("the trainer of bucket (0, 1) died 1 times; giving up (Ray: The "
                              "worker died unexpectedly while executing this task). ")
    assert "give the run more memory" in message and "\n" not in message
    assert user_error(RuntimeError("not a worker")) is None
