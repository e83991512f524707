"""The C row loops (pbg_ray/model/_rows.c) against the torch ops they stand in for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pbg_ray.model import rows
from pbg_ray.model.optim import adagrad_, row_adagrad_


def test_the_extension_is_built():
    # pip builds it wherever a C compiler is found, as on every machine CI runs on.
    assert rows.BUILT


def test_pbg_ray_c_kernels_0_turns_the_c_code_off():
    probe = ("from pbg_ray.model import losses, operators, rows; "
             "print(rows.BUILT, losses._loss is None, operators._operators is None)")
    used = {}
    for setting in ("0", "1"):
        env = dict(os.environ, PBG_RAY_C_KERNELS=setting)
        used[setting] = subprocess.run([sys.executable, "-c", probe], env=env, check=True,
                                       capture_output=True, text=True).stdout.split()
    assert used["0"] == ["False", "True", "True"]
    assert used["1"][0] == "True" and used["1"][2] == "False"  # (_loss needs AVX-512 as well)


def step(monkeypatch, c_loop: bool, dim: int, known: int, known_scale: float):
    """(table, sums, ids) after one row_adagrad_ over 200 ids, many duplicates, of 50 rows."""
    gen = torch.Generator().manual_seed(dim)
    table = torch.randn(50, dim, generator=gen)
    sums = torch.rand(50, generator=gen)
    ids = torch.randint(50, (200,), generator=gen)
    grads = torch.randn(200, dim, generator=gen)
    with monkeypatch.context() as m:
        m.setattr(rows, "BUILT", c_loop)
        row_adagrad_(table, sums, ids, grads, 0.1, torch.empty(50, dtype=torch.long),
                     known, known_scale)
    return table, sums, ids


@pytest.mark.parametrize("dim", [7, 16, 37])  # shorter than, equal to and past a 16-lane block
@pytest.mark.parametrize("known,known_scale", [(0, 1.0), (20, 0.5), (20, 0.0)])
def test_row_adagrad_matches_the_torch_ops(monkeypatch, dim, known, known_scale):
    c_table, c_sums, ids = step(monkeypatch, True, dim, known, known_scale)
    t_table, t_sums, _ = step(monkeypatch, False, dim, known, known_scale)
    # Only the order of the squared-gradient sum differs.
    torch.testing.assert_close(c_sums, t_sums, rtol=1e-6, atol=0)
    torch.testing.assert_close(c_table, t_table, rtol=1e-6, atol=1e-7)
    original = torch.randn(50, dim, generator=torch.Generator().manual_seed(dim))
    stepped = torch.zeros(50, dtype=torch.bool)
    stepped[ids] = True
    if known_scale == 0:
        stepped[:known] = False  # frozen
    assert torch.equal(c_table[~stepped], original[~stepped])
    assert (c_table[stepped] != original[stepped]).any(1).all()


@pytest.mark.parametrize("size", [7, 50, 1003])
def test_adagrad_matches_the_torch_ops(monkeypatch, size):
    gen = torch.Generator().manual_seed(size)
    param, sums = torch.randn(size, generator=gen), torch.rand(size, generator=gen)
    grads = [torch.randn(size, generator=gen) for _ in range(3)]
    stepped = {}
    for c_loop in (True, False):
        p, s = param.clone(), sums.clone()
        with monkeypatch.context() as m:
            m.setattr(rows, "BUILT", c_loop)
            for g in grads:
                adagrad_(p, s, g, 0.1)
        stepped[c_loop] = p, s
    # torch's vectorized square root (and, by CPU, its multiply-add) may round differently.
    for c_value, torch_value in zip(stepped[True], stepped[False]):
        torch.testing.assert_close(c_value, torch_value, rtol=1e-6, atol=0)
    assert (stepped[True][0] != param).all()


def test_gather_copies_the_rows():
    table = torch.randn(1000, 37)
    ids = torch.randint(1000, (500,))
    out = torch.empty(500, 37)
    assert rows.native((table, out), (ids,))
    assert rows.gather_rows(table, ids, out) is out
    assert torch.equal(out, table[ids])


def test_tensors_the_loops_cannot_take_go_to_torch():
    table = torch.randn(37, 100).t()  # a transposed view: not contiguous
    ids = torch.tensor([3, 0, 99, 3])
    assert not rows.native((table, torch.empty(4, 37)), (ids,))
    assert not rows.native((table.contiguous().double(),), (ids,))
    assert not rows.native((table.contiguous(),), (ids.int(),))
    assert torch.equal(rows.gather_rows(table, ids, torch.empty(4, 37)), table[ids])


@pytest.mark.parametrize("bad", [10, -1])
def test_an_id_out_of_range_raises_and_changes_nothing(bad):
    table, sums = torch.randn(10, 5), torch.rand(10)
    ids = torch.tensor([1, 2, bad, 3])
    with pytest.raises(IndexError, match=f"row id {bad} out of range for a table of 10 rows"):
        rows.gather_rows(table, ids, torch.empty(4, 5))
    saved = table.clone(), sums.clone()
    with pytest.raises(IndexError, match=f"row id {bad} out of range"):
        row_adagrad_(table, sums, ids, torch.ones(4, 5), 0.1, torch.empty(10, dtype=torch.long))
    assert torch.equal(table, saved[0]) and torch.equal(sums, saved[1])
