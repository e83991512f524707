"""pbg_ray's batch math against torchbiggraph 1.0.0: scores, loss, gradients, optimizer steps.

`OracleChecks` holds the checks; each case is a subclass (or a parametrization) that only
says which config it runs.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict

import pytest
import torch

from pbg_ray.checkpoints.directory import state_dict_key
from pbg_ray.model.comparators import COMPARATORS as COMPARATORS_REGISTRY
from pbg_ray.model.kernel import train_batch
from pbg_ray.model.losses import LOSS_FUNCTIONS as LOSSES_REGISTRY
from pbg_ray.model.operators import OPERATORS as OPERATORS_REGISTRY
from tests.model.pbg_oracle import dense_row_grads, make_case, oracle, oracle_step, ours, pbg_layout

pytestmark = pytest.mark.oracle

TOL = dict(rtol=1e-5, atol=1e-5)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """Equal to 1e-5 relative to `scale`, the largest gradient entry of the batch (a global
    embedding's gradient sums many rows' gradients, so it carries their rounding)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(1.0, scale))
OPERATORS = OPERATORS_REGISTRY.names()
COMPARATORS = COMPARATORS_REGISTRY.names()
LOSSES = LOSSES_REGISTRY.names()


class OracleChecks:
    """The checks; subclasses set `overrides` (config keys and make_case options)."""

    overrides: Dict[str, Any] = {}

    def case(self, **extra):
        return make_case(**{**self.overrides, **extra})

    def test_scores_loss_and_gradients(self, **extra):
        case = self.case(**extra)
        state, batch = ours(case)
        scores = state.embedder.forward(batch)
        o = oracle(case, batch)
        for side in ("lhs", "rhs"):
            pos, neg = pbg_layout(batch, scores.pos[side], scores.blocks[side])
            torch.testing.assert_close(pos, getattr(o.scores, f"{side}_pos").detach(), **TOL)
            torch.testing.assert_close(neg, getattr(o.scores, f"{side}_neg").detach(), **TOL)
        grads = state.embedder.backward(batch, scores)
        assert grads.loss == pytest.approx(float(o.loss.detach()), rel=1e-5, abs=1e-5)
        for side, expected in zip(("lhs", "rhs"), o.violators):
            # Ties (a negative that is the positive's own pair) may round either way.
            ties = int(((getattr(o.scores, f"{side}_neg") - getattr(o.scores, f"{side}_pos")
                         .unsqueeze(1)).abs() < 1e-5).sum())
            assert abs(grads.violators[side] - expected) <= ties
        assert grads.reg == 0
        ours_rows = dense_row_grads(state, grads.rows)
        theirs_rows, theirs = o.table_grads(), o.grads()
        scale = max(float(g.abs().max()) for g in [*theirs_rows.values(), *theirs.values()])
        for key, g in theirs_rows.items():
            assert_close(ours_rows.get(key, torch.zeros_like(g)), g, scale)
        for name in case.params.arrays:
            expected = theirs[state_dict_key(name)]
            assert_close(grads.params.get(name, torch.zeros_like(expected)), expected, scale)

    def test_optimizer_step(self, **extra):
        case = self.case(**extra)
        state, batch = ours(case)
        owners = {k: torch.empty(len(t), dtype=torch.long) for k, t in state.tables.items()}
        train_batch(state, batch, owners)
        o = oracle(case, batch)
        oracle_step(case, o)
        for key, p in o.tables.items():
            torch.testing.assert_close(state.tables[key], p.detach(), **TOL)
        named = dict(o.model.named_parameters())
        for name in case.params.arrays:
            torch.testing.assert_close(state.params[name], named[state_dict_key(name)].detach(),
                                       **TOL)


GRID = list(itertools.product(OPERATORS, COMPARATORS, LOSSES, (False, True)))


@pytest.mark.parametrize("operator,comparator,loss_fn,dynamic", GRID)
class TestGrid(OracleChecks):
    """Every operator x comparator x loss, per-relation and dynamic."""

    def test_scores_loss_and_gradients(self, operator, comparator, loss_fn, dynamic):
        super().test_scores_loss_and_gradients(
            operator=operator, comparator=comparator, loss_fn=loss_fn, dynamic_relations=dynamic)

    def test_optimizer_step(self, operator, comparator, loss_fn, dynamic):
        super().test_optimizer_step(
            operator=operator, comparator=comparator, loss_fn=loss_fn, dynamic_relations=dynamic)


class TestBiasDot(OracleChecks):
    overrides = dict(bias=True, operator="translation", loss_fn="softmax")


class TestBiasCos(OracleChecks):
    overrides = dict(bias=True, comparator="cos", operator="linear", loss_fn="logistic")


class TestBiasL2(OracleChecks):
    overrides = dict(bias=True, comparator="l2", operator="complex_diagonal")


class TestBiasDynamic(OracleChecks):
    overrides = dict(bias=True, comparator="squared_l2", operator="affine",
                     dynamic_relations=True, loss_fn="softmax")


class TestMaxNorm(OracleChecks):
    overrides = dict(max_norm=1.2, operator="diagonal", loss_fn="softmax")


class TestSameTable(OracleChecks):
    overrides = dict(rhs="a", operator="complex_diagonal", comparator="cos")


class TestSameTableSelfLoops(OracleChecks):
    # 40 edges over 13 entities: self-loops and repeated rows in one table. (squared_l2:
    # l2's square root makes near-zero distances ill-conditioned, see test_comparators.)
    overrides = dict(rhs="a", operator="none", comparator="squared_l2", num_edges=40)


class TestNoGlobalEmb(OracleChecks):
    overrides = dict(global_emb=False, operator="affine", loss_fn="logistic")


class TestUniformOnly(OracleChecks):
    overrides = dict(num_batch_negs=0, num_uniform_negs=6, comparator="cos")


class TestBatchOnly(OracleChecks):
    overrides = dict(num_uniform_negs=0, loss_fn="softmax", comparator="l2")


class TestAllNegs(OracleChecks):
    overrides = dict(all_negs=True, operator="translation", loss_fn="softmax")


class TestAllNegsDynamic(OracleChecks):
    overrides = dict(all_negs=True, operator="diagonal", dynamic_relations=True)


class TestDisableLhs(OracleChecks):
    overrides = dict(disable_lhs_negs=True, loss_fn="logistic", operator="linear")


class TestDisableRhs(OracleChecks):
    overrides = dict(disable_rhs_negs=True, comparator="squared_l2")


class TestDisableRhsDynamic(OracleChecks):
    overrides = dict(disable_rhs_negs=True, dynamic_relations=True, loss_fn="logistic",
                     operator="complex_diagonal")


class TestExactChunks(OracleChecks):
    overrides = dict(num_edges=20, loss_fn="softmax")


class TestSingleEdge(OracleChecks):
    overrides = dict(num_edges=1, comparator="cos")


class TestFeaturizedLhs(OracleChecks):
    overrides = dict(lhs="f", operator="diagonal", loss_fn="softmax")


class TestFeaturizedBoth(OracleChecks):
    overrides = dict(lhs="f", rhs="f", comparator="squared_l2", num_uniform_negs=0)


class TestFeaturizedDynamic(OracleChecks):
    overrides = dict(rhs="f", dynamic_relations=True, operator="translation")


class TestAllNegsL2(OracleChecks):
    overrides = dict(all_negs=True, comparator="l2", loss_fn="logistic", operator="affine")


class TestUniformOnlyL2Dynamic(OracleChecks):
    overrides = dict(num_batch_negs=0, num_uniform_negs=6, comparator="l2",
                     dynamic_relations=True, operator="translation", loss_fn="softmax")


class TestDisableLhsL2(OracleChecks):
    overrides = dict(disable_lhs_negs=True, comparator="l2", bias=True)
