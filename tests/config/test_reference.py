"""The key reference: every field has help text, docs/configuration.md is what the schema
generates, and the commands' --help prints their keys."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pbg_ray.config.options import help_of
from pbg_ray.config.reference import REGENERATE, SECTIONS, document

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("title, prefix, cls", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_every_field_has_help_text(title, prefix, cls):
    missing = [f.name for f in dataclasses.fields(cls) if not help_of(f)]
    assert not missing, f"{cls.__name__} fields without help text: {missing}"


def test_configuration_md_is_up_to_date():
    assert (REPO / "docs" / "configuration.md").read_text() == document(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`")


@pytest.mark.parametrize("command, usage, key", [
    ("import_edges", "python -m pbg_ray.import_edges", "importer.entity_min_count"),
    ("train", "python -m pbg_ray.train", "ray.placement"),
    ("eval", "python -m pbg_ray.eval", "eval.filter_paths"),
])
def test_help_teaches_the_command_and_its_keys(command, usage, key):
    result = subprocess.run([sys.executable, "-m", f"pbg_ray.{command}", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage)
    assert f"| `{key}` |" in result.stdout
    assert "get_torchbiggraph_config()" in result.stdout
    assert "powered by Hydra" not in result.stdout
