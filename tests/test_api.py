"""The public surface: every name in `pbg_ray.__all__` resolves, and every console script
the installed package declares names a command module's main()."""

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
