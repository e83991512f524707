"""The key reference: every field has help text, docs/configuration.md is what the schema
generates, and key_help lists keys as the commands' --help prints them (tests/commands/
test_help.py)."""

import dataclasses
from pathlib import Path

import pytest

from pbg_ray.config.options import help_of
from pbg_ray.config.reference import REGENERATE, SECTIONS, document, key_help

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("title, prefix, cls", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_every_field_has_help_text(title, prefix, cls):
    missing = [f.name for f in dataclasses.fields(cls) if not help_of(f)]
    assert not missing, f"{cls.__name__} fields without help text: {missing}"


def test_configuration_md_is_up_to_date():
    assert (REPO / "docs" / "configuration.md").read_text() == document(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`")


def test_key_help_lists_single_keys_and_sections_with_meaning_and_default():
    text = key_help(("lr", "ray."))
    assert text.startswith("  lr ") and "The learning rate" in text
    assert "Default: 0.01." in " ".join(text.split())
    assert "  ray.placement " in text and "  ray.address " in text
    assert "  dimension " not in text and "importer." not in text
