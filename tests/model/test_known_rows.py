"""The kernel's incremental mode: rows and parameters init_path trained (KnownRows) step at
lr * lr_scale, and stay bit-identical when frozen (lr_scale 0)."""

import numpy as np
import pytest

from pbg_ray.model.kernel import train_bucket
from pbg_ray.model.params import KnownRows
from pbg_ray.types import Bucket
from tests.model.pbg_oracle import make_case

pytestmark = pytest.mark.oracle

KNOWN = {("a", 0): 7, ("b", 0): 5}  # of 13 and 11 rows


def known_params(case):
    """Dynamic mode: the first 2 of 3 relation ids known; else relation 1's parameters
    known and the global embeddings new."""
    if case.config.dynamic_relations:
        return {name: 2 for name in case.params.arrays}
    return {name: value.shape[0] for name, value in case.params.arrays.items()
            if name.startswith("relations/1/")}


@pytest.mark.parametrize("dynamic", [False, True])
def test_frozen_rows_and_parameters_stay_bit_identical(dynamic):
    # max_norm below the rows' norms: training renormalizes looked-up rows in place.
    case = make_case(num_edges=200, operator="translation", max_norm=0.5,
                     dynamic_relations=dynamic)
    parts, params = case.copy_state()
    known = KnownRows(KNOWN, known_params(case), 0.0)
    for epoch in range(2):
        train_bucket(case.config, Bucket(0, 0), case.edges, parts, params, num_threads=2,
                     seed=epoch, known=known)
    for key, n in KNOWN.items():
        (embs, sums), (old_embs, old_sums) = parts[key], case.partitions[key]
        assert embs[:n].tobytes() == old_embs[:n].tobytes()
        assert sums[:n].tobytes() == old_sums[:n].tobytes()
        assert (embs[n:] != old_embs[n:]).any(axis=1).all()
    for name, value in params.arrays.items():
        rows = known.params.get(name, 0)
        assert value[:rows].tobytes() == case.params.arrays[name][:rows].tobytes(), name
        assert params.sums[name][:rows].tobytes() == case.params.sums[name][:rows].tobytes()
        # (Per-relation mode: every edge is relation 1's from type a to b, so relation 0
        # and type f get no gradient.)
        if rows < len(value) and (dynamic or not name.startswith(("relations/0/", "entities/f/"))):
            assert not np.array_equal(value[rows:], case.params.arrays[name][rows:]), name


def test_known_rows_step_at_the_scaled_learning_rate():
    """One batch: the gradients don't depend on the scale, so the known rows' and
    parameters' steps are exactly scaled and the new rows' are the same."""
    case = make_case(num_edges=30, operator="diagonal")
    assert case.config.batch_size >= 30
    moved = {}
    for scale in (1.0, 0.25):
        parts, params = case.copy_state()
        train_bucket(case.config, Bucket(0, 0), case.edges, parts, params, seed=3,
                     known=KnownRows(KNOWN, known_params(case), scale))
        moved[scale] = ({k: parts[k][0] - case.partitions[k][0] for k in KNOWN},
                        {k: params.arrays[k] - case.params.arrays[k] for k in params.arrays})
    for key, n in KNOWN.items():
        full, scaled = moved[1.0][0][key], moved[0.25][0][key]
        assert np.abs(full[:n]).max() > 0
        np.testing.assert_allclose(scaled[:n], 0.25 * full[:n], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(scaled[n:], full[n:], rtol=1e-4, atol=1e-7)
    for name, full in moved[1.0][1].items():
        factor = 0.25 if name.startswith("relations/1/") else 1.0
        np.testing.assert_allclose(moved[0.25][1][name], factor * full, rtol=1e-4, atol=1e-7)
