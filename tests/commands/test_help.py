"""Every command's --help in one style: usage, arguments, the keys set most often with
their meanings and defaults, examples, and where the full reference is."""

import importlib
import re
import subprocess
import sys

import pytest

HYDRA_COMMANDS = ["train", "import_edges", "eval", "export", "tune", "serve"]
ARGPARSE_COMMANDS = ["predict", "plot", "migrate"]


def help_of(command, monkeypatch, capsys):
    main = importlib.import_module(f"pbg_ray.{command}").main
    monkeypatch.setattr(sys, "argv", [f"pbg_ray.{command}", "--help"])
    if command in ARGPARSE_COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0
    else:
        main()
    return capsys.readouterr().out


@pytest.mark.parametrize("command", HYDRA_COMMANDS + ARGPARSE_COMMANDS)
def test_help_has_usage_arguments_examples_and_the_reference(command, monkeypatch, capsys):
    text = help_of(command, monkeypatch, capsys)
    assert text.startswith(f"usage: python -m pbg_ray.{command} ")
    for part in ("positional arguments:", "options:", "examples:", "reference:"):
        assert f"\n{part}" in text, part
    examples = text.split("\nexamples:\n")[1].split("\n\n")[0]
    assert 2 <= examples.count(f"python -m pbg_ray.{command}") <= 4
    assert all(len(line) <= 100 for line in text.splitlines()), command


@pytest.mark.parametrize("command, key", [
    ("train", "ray.placement"), ("import_edges", "importer.inputs"), ("eval", "eval.filter_paths"),
    ("export", "export.format"), ("tune", "tune.search_space"), ("serve", "serve.index")])
def test_hydra_help_lists_the_config_file_and_the_keys_set_most(command, key, monkeypatch,
                                                                  capsys):
    text = help_of(command, monkeypatch, capsys)
    assert "PBG_CONFIG.py" in text and "get_torchbiggraph_config()" in text
    assert "--cfg job" in text and "docs/configuration.md" in text
    listed = re.findall(r"^  ([a-z_<>.]+) {2,}\S.*$", text.split("keys set most often")[1],
                        flags=re.M)
    assert key in listed
    assert 5 <= len(listed) <= 18, listed
    # Each key with its meaning and its default, from the schema's help texts.
    assert re.search(r"^  dimension +The dimension of the embeddings .*\n.*Required "
                     r"\(the demo: 100\)\.$", text, flags=re.M) or command != "train"
    assert "Default:" in text and "powered by Hydra" not in text


def test_help_says_the_defaults_a_run_composes(monkeypatch, capsys):
    """conf/'s options (tune=asha: 8 trials of its space) over the schema's defaults, for
    any run; the demo's values where they differ."""
    text = " ".join(help_of("tune", monkeypatch, capsys).split())
    assert "sample). Default: 8 (tune=asha)." in text
    assert ('Default: {"lr": {"loguniform": [0.01, 0.5]}, "dimension": {"choice": [50, 100, '
            '200]}, "margin": {"uniform": [0.05, 0.5]}} (tune=asha).') in text
    assert "every edge. Default: 1 (the demo: 10)." in text
    assert "found there. Required (the demo sets it)." in text
    assert "eval_edge_paths). Default: null." in text  # tune.metric: the schema's, as tune=asha


@pytest.mark.parametrize("flags, expected", [
    (["--cfg", "job", "export.format=parquet"], ["format: parquet", "checkpoint_path:"]),
    (["--hydra-help"], ["--hydra-help : Hydra's help"]),
])
def test_hydras_config_dump_and_help_are_still_hydras(flags, expected):
    result = subprocess.run([sys.executable, "-m", "pbg_ray.export", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(text in result.stdout for text in expected), result.stdout[-2000:]
