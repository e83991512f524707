"""torch.save's format without torch: torch reads what we write, we read what torch writes,
and the processes that hold partitions never import torch."""

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from pbg_ray.checkpoints import torch_format
from tests.util import as_torch

STATE = {
    "state": {0: {"step": np.zeros((), np.float32), "sum": np.arange(6, dtype=np.float32)},
              1: {"step": 3, "sum": np.arange(12, dtype=np.float64).reshape(3, 4)[:, 1:]}},
    "param_groups": [{"lr": 0.1, "eps": 1e-10, "foreach": None, "maximize": False,
                      "params": [0, 1]}],
    "extra": ("tuple", [np.array([1, 2], np.int64), np.array([True, False])]),
}


def assert_same(ours, theirs):
    """`ours` (numpy) holds the values of `theirs` (torch), structure and dtypes included."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, np.ndarray) and ours.shape == tuple(theirs.shape)
        assert ours.dtype == theirs.numpy().dtype
        np.testing.assert_array_equal(ours, theirs.numpy())
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            assert_same(ours[key], theirs[key])
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)
    else:
        assert ours == theirs and type(ours) is type(theirs)


def test_torch_loads_what_we_write():
    loaded = torch.load(io.BytesIO(torch_format.dumps(STATE)), weights_only=True)
    assert_same(torch_format.loads(torch_format.dumps(STATE)), loaded)
    assert_same(STATE["state"][0]["sum"], loaded["state"][0]["sum"])
    assert loaded["state"][0]["step"].dim() == 0  # a 0-dim tensor, as Adagrad keeps its step


def test_we_read_what_torch_writes():
    buffer = io.BytesIO()
    theirs = as_torch(STATE)
    theirs["shared"] = theirs["state"][0]["sum"][2:]  # a view into another tensor's storage
    torch.save(theirs, buffer)
    assert_same(torch_format.loads(buffer.getvalue()), theirs)


def test_an_adagrad_takes_the_state_we_write():
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(3, 3))]
    optimizer = torch.optim.Adagrad(params, lr=0.1)
    state = {"state": {0: {"step": np.zeros((), np.float32),
                           "sum": np.full(6, 2.0, np.float32)},
                       1: {"step": np.zeros((), np.float32),
                           "sum": np.ones((3, 3), np.float32)}},
             "param_groups": [{**optimizer.state_dict()["param_groups"][0], "lr": 0.5}]}
    optimizer.load_state_dict(torch.load(io.BytesIO(torch_format.dumps(state)),
                                         weights_only=True))
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert torch.equal(optimizer.state[params[0]]["sum"], torch.full((6,), 2.0))


def test_anything_but_tensors_and_plain_values_is_refused():
    buffer = io.BytesIO()
    torch.save({"module": torch.nn.Linear(2, 2)}, buffer)
    with pytest.raises(Exception, match="not allowed in an optimizer state"):
        torch_format.loads(buffer.getvalue())
    with pytest.raises(ValueError, match="not a torch.save archive"):
        torch_format.loads(_zip_without_pickle())


def _zip_without_pickle():
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/version", "3\n")
    return out.getvalue()


@pytest.mark.parametrize("module", ["pbg_ray.training.partition_store", "pbg_ray.checkpoints.manager",
                                    "pbg_ray.model.params"])
def test_partition_holders_load_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False", f"import {module} loaded torch"
