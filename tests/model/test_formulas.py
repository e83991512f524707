"""Features torchbiggraph 1.0.0 lacks, against their formulas: per-edge weights (the
weighted losses of later PBG releases) and the N3 regularizer. The formulas are applied to
torchbiggraph's own scores and parameters, and autograd gives the expected gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pbg_ray.checkpoints.directory import state_dict_key
from tests.model.pbg_oracle import dense_row_grads, make_case, oracle, ours
from tests.model.test_oracle import assert_close

pytestmark = pytest.mark.oracle


def weighted_loss(name: str, margin: float, weight: torch.Tensor):
    """Later PBG's weighted losses: each edge's loss (all its negatives' terms) times its weight."""
    def loss(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        num_neg = neg.shape[1]
        if name == "ranking":
            return (F.relu(margin - pos.unsqueeze(1) + neg).sum(1) * weight).sum()
        if name == "logistic":
            neg_term = F.softplus(neg).sum(1) / num_neg if num_neg else 0
            return ((F.softplus(-pos) + neg_term) * weight).sum()
        if num_neg == 0:
            return pos.new_zeros(())
        return ((torch.logsumexp(torch.cat([pos.unsqueeze(1), neg], 1), 1) - pos) * weight).sum()
    return loss


def check(case, extra=None, side_loss=None, reg=None):
    state, batch = ours(case)
    grads = state.embedder.backward(batch, state.embedder.forward(batch))
    o = oracle(case, batch, side_loss=side_loss, extra=extra)
    assert grads.loss == pytest.approx(float(o.loss.detach()), rel=1e-5)
    if reg is not None:
        assert grads.reg == pytest.approx(reg(o), rel=1e-5)
    mine = dense_row_grads(state, grads.rows)
    theirs_rows, theirs = o.table_grads(), o.grads()
    scale = max(float(g.abs().max()) for g in [*theirs_rows.values(), *theirs.values()])
    for key, g in theirs_rows.items():
        assert_close(mine.get(key, torch.zeros_like(g)), g, scale)
    for name in case.params.arrays:
        expected = theirs[state_dict_key(name)]
        assert_close(grads.params.get(name, torch.zeros_like(expected)), expected, scale)


@pytest.mark.parametrize("loss_fn", ["ranking", "logistic", "softmax"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_edge_weights(loss_fn, dynamic):
    case = make_case(weights=True, loss_fn=loss_fn, operator="diagonal",
                     dynamic_relations=dynamic)
    weight = torch.tensor(case.edges.weight)
    check(case, side_loss=weighted_loss(loss_fn, case.config.margin, weight))


def n3_formula(case, coef: float):
    """coef * (sum over positives of m(lhs + global)^3 + m(rhs + global)^3 + the operator
    parameters each edge uses), m = |x|, or complex moduli for complex_diagonal."""
    c = case.config
    rel = c.relations[0]
    complex_pairs = rel.operator == "complex_diagonal"

    def cubes(x: torch.Tensor) -> torch.Tensor:
        if complex_pairs:
            re, im = x.chunk(2, dim=-1)
            return (re * re + im * im).sqrt().pow(3).sum()
        return x.abs().pow(3).sum()

    def extra(model, tables) -> torch.Tensor:
        total = 0
        for side in ("lhs", "rhs"):
            entity = getattr(rel, side)
            x = tables[(entity, 0)][torch.tensor(getattr(case.edges, side))]
            if c.global_emb:
                x = x + model.global_embs["emb_" + entity]
            total = total + cubes(x)
        ids = torch.tensor(case.edges.rel)
        names = {"diagonal": ["diagonal"], "translation": ["translation"],
                 "complex_diagonal": ["real", "imag"], "none": []}[rel.operator]
        sides = ("lhs", "rhs") if c.dynamic_relations else ("rhs",)
        for side in sides:
            op = getattr(model, f"{side}_operators")[0 if c.dynamic_relations else 1]
            if c.dynamic_relations:
                names_d = {"diagonal": ["diagonals"], "translation": ["translations"]}.get(
                    rel.operator, names)
                p = [getattr(op, n)[ids] for n in names_d]
                scale = 1
            else:
                p = [getattr(op, n) for n in names]
                scale = len(case.edges)
            if p:
                total = total + scale * (cubes(torch.cat(p, -1)) if complex_pairs
                                         else sum(cubes(t) for t in p))
        return coef * total
    return extra


@pytest.mark.parametrize("operator", ["none", "diagonal", "translation", "complex_diagonal"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_n3(operator, dynamic):
    coef = 0.05
    case = make_case(regularization_coef=coef, operator=operator, dynamic_relations=dynamic,
                     loss_fn="softmax")
    extra = n3_formula(case, coef)
    check(case, extra=extra,
          reg=lambda o: float(extra(o.model, o.tables).detach()))


def test_linear_operator_refuses_n3():
    from pbg_ray.errors import PbgRayError
    with pytest.raises(PbgRayError, match="regularization_coef"):
        make_case(regularization_coef=0.1, operator="linear")
