"""The public surface: every name in `pbg_ray.__all__` resolves, every console script the
installed package declares names a command module's main(), `python -m pbg_ray` lists
them, and a config changed after it was built is checked before anything starts."""

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

import pbg_ray


@pytest.mark.parametrize("name", pbg_ray.__all__)
def test_every_public_name_resolves(name):
    assert getattr(pbg_ray, name) is not None
    assert name in dir(pbg_ray)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        pbg_ray.trian


def test_train_is_callable_and_is_the_command():
    assert callable(pbg_ray.train) and pbg_ray.train.__name__ == "pbg_ray.train"


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

    config = pbg_ray.ConfigSchema.from_dict(config_dict(tmp_path))
    config.num_epochs = "three"
    with pytest.raises(pbg_ray.PbgRayError, match=r"^config: num_epochs: expected an integer, "
                                                  r"got 'three'$"):
        getattr(pbg_ray, call)(config)
    assert not (tmp_path / "checkpoints").exists()


def test_one_path_for_a_list_of_paths_becomes_the_list(tmp_path):
    from tests.util import config_dict

    config = pbg_ray.ConfigSchema.from_dict(config_dict(tmp_path))
    config.edge_paths = str(tmp_path / "train")
    assert config.checked().edge_paths == [str(tmp_path / "train")]
