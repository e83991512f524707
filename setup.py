"""The optional C extensions pbg_ray.model._rows, _loss and _operators; all else is
declared in pyproject.toml.

Optional: without a C compiler the install goes on and the CPU kernel uses torch ops
for its row gathers and RowAdagrad steps (pbg_ray/model/rows.py), its softmax loss
(pbg_ray/model/losses.py) and its complex_diagonal operator (pbg_ray/model/operators.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("pbg_ray.model._rows", ["pbg_ray/model/_rows.c"],
              # No fused multiply-adds: the row update rounds like torch's mul then add.
              extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
    Extension("pbg_ray.model._loss", ["pbg_ray/model/_loss.c"],
              extra_compile_args=["-O3"], optional=True),
    # No fused multiply-adds: the operator rounds like torch's products and sums.
    Extension("pbg_ray.model._operators", ["pbg_ray/model/_operators.c"],
              extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
])
