"""The README: at most 200 lines, links only files a clone has, its test command is what CI
runs, bound by constraints.txt, its "Your own graph" shows the very files of
examples/own_graph/, which import and train as it says, and its Tune search starts from
the quality recipe."""

import functools
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import yaml
from hydra import compose, initialize_config_module

from pbg_ray import api
from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import load_pbg_config_file
from pbg_ray.config.hydra import to_config
from pbg_ray.config.tune import flat_search_space, in_space

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
OWN_GRAPH = REPO / "examples" / "own_graph"
CONFIG_FILE = OWN_GRAPH / "config.py"
YAML_FILE = OWN_GRAPH / "conf" / "graph" / "shop.yaml"


def test_readme_is_short_and_links_only_files_of_the_clone():
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(\s*([^)\s]+)\)", README)
    local = [link for link in links if "://" not in link and not link.startswith("#")]
    assert len(local) >= 5
    assert [link for link in local if not (REPO / link.split("#")[0]).exists()] == []


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_ci_runs_the_readmes_test_command_bound_by_the_constraints():
    command = next(line for line in README.splitlines()
                   if line.startswith("pip install") and "[dev]" in line)
    assert "-c constraints.txt" in command and "pytest" in command
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
    pinned = {requirement_name(line) for line in (REPO / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {requirement_name(r) for r in project["dependencies"]
              + [r for extra in project["optional-dependencies"].values() for r in extra]}
    assert wanted - pinned == set()


def test_readme_shows_the_example_config_file_and_yaml_graph_verbatim():
    blocks = re.findall(r"```(\w*)\n(.*?)```\n", README, flags=re.S)
    assert ("python", CONFIG_FILE.read_text()) in blocks
    assert ("yaml", YAML_FILE.read_text()) in blocks


def write_edges(path: Path, rng, count: int) -> None:
    users, items = [f"user{i}" for i in range(30)], [f"item{i}" for i in range(20)]
    rows = [(rng.choice(users), "follows", rng.choice(users)) if rng.random() < 0.5
            else (rng.choice(users), "likes", rng.choice(items)) for _ in range(count)]
    path.write_text("".join("\t".join(row) + "\n" for row in rows))


def test_the_example_config_file_and_yaml_graph_import_and_train(ray_session, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)  # their paths are relative, as a user's are
    rng = np.random.default_rng(0)
    write_edges(tmp_path / "train.tsv", rng, 300)
    write_edges(tmp_path / "test.tsv", rng, 30)
    config = load_pbg_config_file(CONFIG_FILE).with_absolute_paths()
    config = config.from_dict(dict(config.to_dict(), num_epochs=1,
                                   eval_edge_paths=[str(tmp_path / "data" / "test")],
                                   importer={"inputs": ["train.tsv", "test.tsv"]}))
    api.import_graph(config)
    assert api.train(config).version == 1
    assert CheckpointStorage(tmp_path / "model").load_version() == 1

    with initialize_config_module("pbg_ray.conf", version_base=None):
        cfg = compose("config", overrides=[
            "graph=shop", f"hydra.searchpath=[file://{OWN_GRAPH / 'conf'}]", "num_epochs=1",
            "dimension=8", "checkpoint_path=model-yaml"])
    from_yaml = to_config(cfg)
    assert [r.name for r in from_yaml.relations] == [r.name for r in config.relations]
    assert from_yaml.entity_path == config.entity_path
    assert from_yaml.eval_edge_paths == [str(tmp_path / "data" / "test")]
    assert api.train(from_yaml).version == 1


def test_the_readmes_tune_search_starts_from_the_quality_recipe_and_searches_around_it(
        tmp_path):
    """The README's `python -m pbg_ray.tune` command, on its own graph's config file,
    composes the quality recipe (every key conf/training/quality.yaml sets) and a search
    space that draws from around each of the recipe's values it samples: the first trial
    (the recipe) is one of the space's, and no trial leaves what the recipe sets."""
    section = README.split("## Sweeps and Ray Tune\n")[1].split("\n## ")[0]
    command = next(line for line in section.replace("\\\n", " ").splitlines()
                   if line.startswith("python -m pbg_ray.tune "))
    args = shlex.split(command)[3:]
    assert args[0] == "config.py"
    shutil.copy(CONFIG_FILE, tmp_path / "config.py")
    out = subprocess.run([sys.executable, "-m", "pbg_ray.tune", *args, "--cfg", "job"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    composed = yaml.safe_load(out.stdout)
    value = lambda key: functools.reduce(lambda node, name: node[name], key.split("."),  # noqa: E731
                                         composed)
    recipe = yaml.safe_load((REPO / "conf" / "training" / "quality.yaml").read_text())
    assert {key: value(key) for key in flat(recipe)} == flat(recipe)
    space = flat_search_space(composed["tune"]["search_space"])
    assert {"lr", "dimension"} <= space.keys()
    for key, spec in space.items():
        assert in_space(spec, value(key)), (key, spec, value(key))


def flat(tree, prefix=""):
    """{dotted key: value} of a nested mapping."""
    return {k: v for key, node in tree.items() for k, v in (
        flat(node, f"{prefix}{key}.") if isinstance(node, dict) else {f"{prefix}{key}": node}
    ).items()}
