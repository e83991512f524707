"""python -m pbg_ray.plot draws a real run's training_stats.json into a PNG."""

import subprocess
import sys
from pathlib import Path

import matplotlib.image

from pbg_ray.plot import main


def test_plot_of_a_trained_checkpoint_is_a_real_png(trained_config, tmp_path, capsys):
    main([trained_config.checkpoint_path])
    output = Path(trained_config.checkpoint_path) / "training_stats.png"
    assert capsys.readouterr().out.strip() == str(output)
    image = matplotlib.image.imread(output)  # decodes as a PNG
    assert image.shape[:2] == (800, 1200) and output.stat().st_size > 20_000
    # Not a blank canvas: the curves and text put many distinct colours on it.
    assert len({tuple(p) for p in image.reshape(-1, image.shape[-1])[::97]}) > 20

    other = tmp_path / "elsewhere" / "plot.png"
    main([trained_config.checkpoint_path, "--output", str(other)])
    assert other.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_directory_without_stats_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pbg_ray.plot", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "training_stats.json' is missing or holds no bucket stats" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
