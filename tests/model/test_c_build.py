"""The build of the C loops (setup.py, pbg_ray/model/_simd.h): every loop marked
`#pragma omp simd` vectorized, as the compiler's vectorization report says, for x86-64's
AVX-512, AVX2 and baseline builds and for aarch64's NEON and SVE (a cross-compiler from
Debian's packages: gcc-aarch64-linux-gnu with libc6-dev-arm64-cross, which .ci/run
installs), the import's key table (pbg_ray/importer/_key_table.c) built beside them; and
an install without a C compiler going on with one warning, the kernel then on torch's
ops and the import on pandas' hash table."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from pbg_ray.model import native

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "pbg_ray" / "model").glob("_*.c"))
LOOPS = {"_rows", "_loss", "_operators"}  # the kernel's, with `#pragma omp simd` loops
EXTENSIONS = LOOPS | {"_key_table"}
CROSS = "aarch64-linux-gnu-gcc"
CROSS_HEADERS = Path("/usr/aarch64-linux-gnu/include/stdlib.h")  # libc6-dev-arm64-cross's
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}  # e_machine of an ELF header
REPORT = re.compile(r"pbg_ray/model/(_\w+\.c):(\d+):\d+: optimized: loop vectorized using "
                    r"(\d+ byte|variable length) vectors")


def build(tmp_path: Path, **env: str) -> Tuple[subprocess.CompletedProcess, Path]:
    """setup.py's build_ext into tmp_path, with `env` added (CC, CFLAGS, ...)."""
    lib = tmp_path / "lib"
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(lib),
         "--build-temp", str(tmp_path / "temp"), "--force"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, lib


def built(lib: Path) -> Dict[str, Path]:
    return {p.name.split(".")[0]: p for p in (lib / "pbg_ray").glob("*/_*.so")}


def vector_widths(report: str) -> Dict[Tuple[str, int], Set[str]]:
    """Per (source, line) the vector widths its loops were vectorized with."""
    widths: Dict[Tuple[str, int], Set[str]] = {}
    for name, line, width in REPORT.findall(report):
        widths.setdefault((name, int(line)), set()).add(width)
    return widths


def marked_loops() -> List[Tuple[str, int]]:
    loops = [(src.name, number) for src in SOURCES
             for number, text in enumerate(src.read_text().splitlines(), 1)
             if text.strip().startswith("#pragma omp simd")]
    assert {name for name, _ in loops} == {f"{e}.c" for e in LOOPS}
    return loops


def assert_every_marked_loop_vectorized(report: str, widths_wanted: Set[str]) -> None:
    """Each `#pragma omp simd` loop has reports of every width wanted (a loop is reported
    at its pragma's line or one of the three after it)."""
    widths = vector_widths(report)
    missing = []
    for name, line in marked_loops():
        found = set().union(*(widths.get((name, line + k), set()) for k in range(4)))
        if not widths_wanted <= found:
            missing.append(f"{name}:{line} vectorized with {sorted(found)}")
    assert not missing, f"wanted {sorted(widths_wanted)}: " + "; ".join(missing)


def elf_machine(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 builds (this CPU is "
                    "not x86-64: the aarch64 test below is its build)")
def test_the_loops_vectorize_for_avx512_avx2_and_the_baseline(tmp_path):
    done, lib = build(tmp_path, CFLAGS="-fopt-info-vec-optimized")
    # One build per instruction set of each marked function: 64-byte vectors for
    # AVX-512, 32 for AVX2, 16 for the baseline's SSE2.
    assert_every_marked_loop_vectorized(done.stderr, {"64 byte", "32 byte", "16 byte"})
    assert set(built(lib)) == EXTENSIONS
    assert {elf_machine(p) for p in built(lib).values()} == {ELF_MACHINE["x86_64"]}


@pytest.mark.skipif(shutil.which(CROSS) is None or not CROSS_HEADERS.exists(),
                    reason=f"no {CROSS} with its C library's headers ({CROSS_HEADERS}) here: "
                    "Debian's packages gcc-aarch64-linux-gnu and libc6-dev-arm64-cross have "
                    "them (.ci/run installs both where apt-get is)")
@pytest.mark.parametrize("march,width", [("", "16 byte"),  # NEON, every ARMv8 CPU's
                                         ("-march=armv8.2-a+sve", "variable length")])
def test_the_loops_build_and_vectorize_for_arm(tmp_path, march, width):
    # Compiled against this Python's headers (the same layout on either 64-bit
    # little-endian target) and linked without the C library, which the cross package
    # lacks and a loaded module takes from the process.
    done, lib = build(tmp_path, CC=CROSS, LDSHARED=f"{CROSS} -shared -nostdlib",
                      CFLAGS=f"-fopt-info-vec-optimized {march}")
    assert_every_marked_loop_vectorized(done.stderr, {width})
    assert set(built(lib)) == EXTENSIONS
    assert {elf_machine(p) for p in built(lib).values()} == {ELF_MACHINE["aarch64"]}


def test_without_a_c_compiler_the_build_goes_on_with_one_warning(tmp_path):
    done, lib = build(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert not built(lib)
    lines = [line for line in done.stderr.splitlines() if "pbg_ray's C loops" in line]
    assert len(lines) == 1 and "_rows, _loss, _operators, _key_table" in lines[0]
    assert "Install a C compiler" in lines[0]


def test_a_process_without_the_c_loops_warns_once_and_runs_torch(monkeypatch):
    def not_built(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(native.importlib, "import_module", not_built)
    native._warn_not_built.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [native.extension(n) for n in sorted(LOOPS) * 2] == [None] * 6
            assert native.extension("_key_table", "pbg_ray.importer") is None
        assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
            str(caught[0].message)]
        assert "not built" in str(caught[0].message)
        assert "Install a C compiler" in str(caught[0].message)
    finally:
        native._warn_not_built.cache_clear()
