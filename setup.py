"""The optional C extensions pbg_ray.model._rows, _loss and _operators, and
pbg_ray.importer._key_table; all else is declared in pyproject.toml.

Optional: without a C compiler the install goes on, with one warning, and the CPU kernel
uses torch ops for its row gathers and RowAdagrad steps (pbg_ray/model/rows.py), its
softmax loss (pbg_ray/model/losses.py) and its complex_diagonal operator
(pbg_ray/model/operators.py), and the import looks its names' keys up in pandas' hash
table (pbg_ray/importer/name_index.py). How the loops vectorize on each CPU:
pbg_ray/model/_simd.h.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -fopenmp-simd: the loops' `#pragma omp simd` (no OpenMP runtime); -fno-trapping-math: no
# loop relies on floating-point exceptions, and without it GCC keeps the exponential's
# loops scalar on SSE2 and NEON (its selects may not become vector blends). No fused
# multiply-adds in _rows.c and _operators.c: their arithmetic rounds like torch's.
SIMD = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]
EXACT = SIMD + ["-ffp-contract=off"]
HEADERS = ["pbg_ray/model/_simd.h"]


class BuildOptional(build_ext):
    """build_ext that goes on where an extension does not build, and says so once."""

    def run(self):
        self.failed = []
        super().run()
        if self.failed:
            print(f"WARNING: pbg_ray's C loops ({', '.join(self.failed)}) did not build (no "
                  "working C compiler?): the CPU kernel runs torch ops instead, and the import "
                  "pandas' hash table, slower. Install a C compiler (gcc) and reinstall pbg_ray "
                  "to build them.",
                  file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception:  # a compiler missing or failing: the torch path serves
            self.failed.append(ext.name.rsplit(".", 1)[-1])


setup(cmdclass={"build_ext": BuildOptional}, ext_modules=[
    Extension("pbg_ray.model._rows", ["pbg_ray/model/_rows.c"], depends=HEADERS,
              extra_compile_args=EXACT),
    Extension("pbg_ray.model._loss", ["pbg_ray/model/_loss.c"], depends=HEADERS,
              extra_compile_args=SIMD),
    Extension("pbg_ray.model._operators", ["pbg_ray/model/_operators.c"], depends=HEADERS,
              extra_compile_args=EXACT),
    Extension("pbg_ray.importer._key_table", ["pbg_ray/importer/_key_table.c"],
              extra_compile_args=["-O3"]),
])
