"""The key reference: every field has help text, docs/configuration.md is what the schema
generates, and the commands' --help prints their keys."""

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from pbg_ray.config.options import help_of
from pbg_ray.config.reference import REGENERATE, SECTIONS, document, markdown

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("title, prefix, cls", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_every_field_has_help_text(title, prefix, cls):
    missing = [f.name for f in dataclasses.fields(cls) if not help_of(f)]
    assert not missing, f"{cls.__name__} fields without help text: {missing}"


def test_configuration_md_is_up_to_date():
    assert (REPO / "docs" / "configuration.md").read_text() == document(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`")


def test_a_reference_of_sections_and_single_keys():
    text = markdown(("ray.", "entity_path"))
    assert "| `ray.placement` |" in text and "| `entity_path` |" in text
    assert "| `lr` |" not in text and "importer." not in text


@functools.lru_cache(maxsize=None)
def run_command(command, flag):
    return subprocess.run([sys.executable, "-m", f"pbg_ray.{command}", flag],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command, flag, key", [
    ("import_edges", "--help", "importer.entity_min_count"),
    ("train", "--help", "ray.placement"),
    ("eval", "-h", "eval.filter_paths"),
    ("export", "--help", "export.format"),
    ("tune", "--help", "tune.search_space"),
])
def test_help_teaches_the_command_and_its_keys(command, flag, key):
    result = run_command(command, flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"python -m pbg_ray.{command} ")
    assert f"| `{key}` |" in result.stdout
    assert "get_torchbiggraph_config()" in result.stdout
    assert "powered by Hydra" not in result.stdout


def test_import_edges_help_lists_the_data_paths_not_the_training_keys():
    result = run_command("import_edges", "--help")
    assert "| `entity_path` |" in result.stdout and "| `edge_paths` |" in result.stdout
    assert "| `lr` |" not in result.stdout


def test_hydra_help_is_still_hydras():
    result = run_command("export", "--hydra-help")
    assert result.returncode == 0, result.stderr
    assert "--hydra-help : Hydra's help" in result.stdout
