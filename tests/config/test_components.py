"""The component names config checks without importing the model are the model's own."""

from pbg_ray.config import components
from pbg_ray.model.comparators import COMPARATORS
from pbg_ray.model.losses import LOSS_FUNCTIONS
from pbg_ray.model.operators import OPERATORS
from pbg_ray.model.regularizers import REGULARIZERS


def test_names_match_the_model_registries():
    assert components.OPERATORS == OPERATORS.names()
    assert components.COMPARATORS == COMPARATORS.names()
    assert components.LOSS_FUNCTIONS == LOSS_FUNCTIONS.names()
    assert components.REGULARIZERS == REGULARIZERS.names()


def test_unregularized_operators_are_those_without_reg_params():
    assert components.UNREGULARIZED_OPERATORS == {
        name for name in OPERATORS.names() if OPERATORS.get(name).reg_params is None}


def test_same_dimension_operators_are_those_with_parameters():
    """An operator's parameters are shaped by one dimension, so it maps a d-dimensional lhs
    onto a d-dimensional rhs; only the identity ("none") has none."""
    assert components.SAME_DIMENSION_OPERATORS == {
        name for name in OPERATORS.names() if OPERATORS.get(name).param_names}
