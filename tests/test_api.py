"""The public surface: pbg_ray.api holds what the README's Python API uses, every console
script the installed package declares names a command module's main(), `python -m
pbg_ray` lists them, and a config changed after it was built is checked before anything
starts."""

import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pbg_ray
from pbg_ray import api

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_api_module_holds_what_the_readme_uses_and_each_name_resolves():
    block = README.read_text().split("## Python API\n")[1].split("```")[1]
    used = set(re.findall(r"\bapi\.(\w+)", block)) | set(
        re.findall(r"`api\.(\w+)`", README.read_text()))
    assert used and used <= set(api.__all__), used - set(api.__all__)
    assert all(getattr(api, name) is not None for name in api.__all__)
    assert {n for n in dir(api) if not n.startswith("_")} >= set(api.__all__)


@pytest.mark.parametrize("name", pbg_ray.__all__)
def test_the_package_names_resolve(name):
    assert getattr(pbg_ray, name) is not None


SCRIPTS = {entry.name: entry.value
           for entry in importlib.metadata.distribution("pbg-ray").entry_points
           if entry.group == "console_scripts"}
COMMANDS = ["train", "import_edges", "eval", "predict", "export", "migrate", "plot", "tune",
            "serve"]


def test_every_command_has_a_console_script():
    assert sorted(SCRIPTS.values()) == sorted(f"pbg_ray.{c}:main" for c in COMMANDS)
    assert sorted(SCRIPTS) == sorted("pbg-ray-" + c.replace("_", "-") for c in COMMANDS)


@pytest.mark.parametrize("target", sorted(SCRIPTS.values()))
def test_a_console_script_names_a_main(target):
    module, function = target.split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_model_never_loads_ray():
    code = ("import sys, pbg_ray.model.kernel; "
            "print(any(m.split('.')[0] == 'ray' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_python_m_pbg_ray_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "pbg_ray"], capture_output=True, text=True,
                          timeout=60, check=True)
    assert {line.split()[0] for line in proc.stdout.splitlines()
            if line.startswith("  ")} == set(COMMANDS)


@pytest.mark.parametrize("call", ["train", "evaluate", "export_checkpoint", "import_graph"])
def test_a_config_changed_after_loading_is_refused_before_anything_starts(tmp_path, call):
    from tests.util import config_dict

    config = api.ConfigSchema.from_dict(config_dict(tmp_path))
    config.num_epochs = "three"
    with pytest.raises(api.PbgRayError, match=r"^config: num_epochs: expected an integer, "
                                              r"got 'three'$"):
        getattr(api, call)(config)
    assert not (tmp_path / "checkpoints").exists()


def test_one_path_for_a_list_of_paths_becomes_the_list(tmp_path):
    from tests.util import config_dict

    config = api.ConfigSchema.from_dict(config_dict(tmp_path))
    config.edge_paths = str(tmp_path / "train")
    assert config.checked().edge_paths == [str(tmp_path / "train")]
