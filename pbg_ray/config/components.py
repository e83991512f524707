"""The names of the model's components a config may pick, for checking a config without
importing the model (torch). tests/config/test_components.py checks that they match the
model's registries (pbg_ray/model: operators, comparators, losses, regularizers)."""

OPERATORS = ("none", "diagonal", "translation", "linear", "affine", "complex_diagonal")
# Operators whose parameters the regularizer can't reach (reg_params is None).
UNREGULARIZED_OPERATORS = frozenset({"linear", "affine"})
# Operators that map a d-dimensional lhs onto a d-dimensional rhs.
SAME_DIMENSION_OPERATORS = frozenset({"linear", "affine", "complex_diagonal", "diagonal",
                                      "translation"})
COMPARATORS = ("dot", "cos", "squared_l2", "l2")
LOSS_FUNCTIONS = ("ranking", "logistic", "softmax")
REGULARIZERS = ("N3",)
BUCKET_ORDERS = ("random", "affinity", "inside_out", "outside_in", "beta")
