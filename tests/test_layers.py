"""The package's rooms by domain, and what each may import, enforced.

    types, errors  <-  config  <-  model, io  <-  checkpoints  <-  runtime (Ray plumbing)
    incremental (checkpoints)    importer (runtime)    evaluation (runtime)
    training (evaluation, incremental)    serving (evaluation)    tuning (training)
    commands (pbg_ray/*.py at the top: every room)

config, model, io and checkpoints never import Ray (nor incremental); `model` never imports
io and `io` never imports model; `import pbg_ray.config` loads neither torch, ray nor
pyarrow. Imports inside functions count as much as those at the top of a module, for the
rooms and for the cycle check (those under `if TYPE_CHECKING:` never run and count for
neither). The drivers of train, eval and export load no torch: only their tasks' workers
run the kernel. docs/architecture.md says the same in prose; change both together.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pbg_ray"

# Each room and the rooms its modules may import (its own included).
BASE = {"types", "errors"}
ALLOWED: Dict[str, Set[str]] = {"base": {"base"}, "config": {"base", "config"}}
ALLOWED["model"] = ALLOWED["config"] | {"model"}
ALLOWED["io"] = ALLOWED["config"] | {"io"}
ALLOWED["checkpoints"] = ALLOWED["model"] | ALLOWED["io"] | {"checkpoints"}
ALLOWED["runtime"] = ALLOWED["checkpoints"] | {"runtime"}
ALLOWED["incremental"] = ALLOWED["checkpoints"] | {"incremental"}
ALLOWED["importer"] = ALLOWED["runtime"] | {"importer"}
ALLOWED["evaluation"] = ALLOWED["runtime"] | {"evaluation"}
ALLOWED["training"] = ALLOWED["evaluation"] | ALLOWED["incremental"] | {"training"}
ALLOWED["serving"] = ALLOWED["evaluation"] | {"serving"}
ALLOWED["tuning"] = ALLOWED["training"] | {"tuning"}
ALLOWED["commands"] = set().union(*ALLOWED.values()) | {"commands"}

# Third-party packages a room may not import at all.
FORBIDDEN_PACKAGES = {"base": {"torch", "ray", "pyarrow"}, "config": {"torch", "ray", "pyarrow"},
                      "model": {"ray", "pyarrow"}, "io": {"torch", "ray"},
                      "checkpoints": {"ray"}, "incremental": {"ray"}}


def room_of(module: str) -> str:
    """The room of a dotted pbg_ray module name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "commands"  # pbg_ray/__init__.py: the API over every room
    if parts[1] in BASE:
        return "base"
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return "commands"
    return parts[1]


def modules() -> Iterator[Tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parts[-2] == "conf":
            continue
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def runtime_nodes(tree: ast.Module, top_level_only: bool) -> Iterator[ast.AST]:
    """The statements that run: every node (or the module's own statements), those under
    `if TYPE_CHECKING:` left out."""
    todo: List[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            todo += node.orelse
            continue
        yield node
        if not top_level_only:
            todo += ast.iter_child_nodes(node)


def imports(module: str, path: Path, top_level_only: bool = False) -> List[Tuple[str, int]]:
    """(imported module, line) for every import statement of the module that runs."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in runtime_nodes(tree, top_level_only):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[: len(module.split(".")) - node.level
                                           + (path.name == "__init__.py")]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((name, node.lineno))
            # `from pbg_ray.x import y` may import the submodule pbg_ray.x.y
            found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names
                      if name.startswith("pbg_ray") and
                      (PACKAGE.parent / f"{name}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()]
    return sorted(found, key=lambda item: item[1])


ALL_MODULES = dict(modules())


def test_the_room_map_knows_every_subpackage():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"conf"}
    assert subpackages <= set(ALLOWED), f"add {subpackages - set(ALLOWED)} to tests/test_layers.py"


@pytest.mark.parametrize("module", sorted(ALL_MODULES))
def test_module_imports_only_the_rooms_it_may(module):
    room = room_of(module)
    wrong = []
    for name, line in imports(module, ALL_MODULES[module]):
        top = name.split(".")[0]
        if top == "pbg_ray":
            if room_of(name) not in ALLOWED[room]:
                wrong.append(f"line {line}: {name} ({room_of(name)})")
        elif top in FORBIDDEN_PACKAGES.get(room, ()):
            wrong.append(f"line {line}: {name}")
    assert not wrong, (f"{module} is in room {room!r}, which may import only "
                       f"{sorted(ALLOWED[room])}; it imports: " + "; ".join(wrong))


def test_no_import_cycles_between_modules():
    """Imports form no cycle, those inside functions included: every module imports on its
    own in any order, and no two modules lean on each other."""
    graph = {m: {name for name, _ in imports(m, p) if name in ALL_MODULES}
             for m, p in ALL_MODULES.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            # a package and its own submodules (pbg_ray.model -> pbg_ray.model.kernel) are fine
            if len(component) > 1 and not all(c.startswith(min(component, key=len)) for c in component):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", ["pbg_ray", "pbg_ray.config", "pbg_ray.types", "pbg_ray.errors"])
def test_light_modules_load_no_heavy_package(module):
    code = (f"import sys, {module}; "
            "print(' '.join(m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == [], f"import {module} loaded {loaded}"


# Run as `python -c RUN_COMMAND <module> <args>`: the command's main, then the modules of
# DRIVER_MODULES that the driver process loaded.
DRIVER_MODULES = ("torch", "numpy")
RUN_COMMAND = f"""
import runpy, sys
module = sys.argv.pop(1)
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    print("LOADED", *(m for m in {DRIVER_MODULES!r} if m in sys.modules))
"""


def test_the_train_eval_and_export_drivers_load_no_torch(tmp_path, ray_session):
    """Only tasks run the kernel: each command's driver, its work on a tiny graph done (on
    the session's Ray, whose workers are other processes), has not loaded torch."""
    from pbg_ray.config import ConfigSchema
    from tests.util import config_dict, joining_the_session, write_random_graph

    data = config_dict(tmp_path / "data", num_epochs=1, eval_fraction=0.2, dimension=4)
    data["eval_edge_paths"] = data["edge_paths"]  # the trainer evaluates after training too
    write_random_graph(ConfigSchema.from_dict(data), num_edges=50)
    module = tmp_path / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    env = dict(os.environ, **joining_the_session(ray_session))
    loaded = {}
    for command, *args in (("pbg_ray.train",), ("pbg_ray.eval",),
                           ("pbg_ray.export", f"export.output={tmp_path / 'export'}")):
        proc = subprocess.run([sys.executable, "-c", RUN_COMMAND, command, str(module), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command} failed:\n{proc.stderr[-3000:]}"
        line = next(line for line in proc.stdout.splitlines() if line.startswith("LOADED"))
        loaded[command] = line.split()[1:]
    assert all(modules == ["numpy"] for modules in loaded.values()), loaded


TESTS = PACKAGE.parent / "tests"
# The oracle's helper modules: torchbiggraph's own code seen from the tests.
ORACLE_HELPERS = {"tests.oracle", "tests.model.pbg_oracle"}


def marked_oracle(node: ast.AST) -> bool:
    """Whether a decorator list or a `pytestmark = ...` value names the oracle marker."""
    return "mark.oracle" in ast.unparse(node)


def oracle_imports_outside_oracle_tests(path: Path) -> List[str]:
    """`line N` of each import of torchbiggraph or an oracle helper that is neither in a
    module marked oracle nor in a test (or class) marked oracle."""
    tree = ast.parse(path.read_text(), str(path))
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                             for t in n.targets) and marked_oracle(n.value)
           for n in tree.body):
        return []
    wrong: List[str] = []

    def visit(node: ast.AST, marked: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            marked = marked or any(marked_oracle(d) for d in node.decorator_list)
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if not marked and any(n.split(".")[0] == "torchbiggraph" or n in ORACLE_HELPERS
                              for n in names):
            wrong.append(f"line {node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, marked)

    visit(tree, False)
    return wrong


def test_torchbiggraph_is_imported_only_by_oracle_tests():
    """`pytest -m "not oracle"` runs without torchbiggraph: only tests marked oracle (or
    modules whose pytestmark says so) import it or the helpers that wrap it."""
    helper_paths = {TESTS.parent / (h.replace(".", "/") + ".py") for h in ORACLE_HELPERS}
    wrong = {str(p.relative_to(TESTS.parent)): lines for p in sorted(TESTS.rglob("*.py"))
             if p not in helper_paths and (lines := oracle_imports_outside_oracle_tests(p))}
    assert not wrong, f"imports of torchbiggraph outside tests marked oracle: {wrong}"
