"""The commands as a user meets them, in real subprocesses: mistakes in config files get one
line naming the file, a failed command leaves nothing on disk, the working directory stays
clean, Ctrl-C stops a run at once with one line and the rerun resumes, and `tune` searches
the default space of a PBG config file."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from pbg_ray.config import ConfigSchema
from pbg_ray.config.hydra import name_sweep_jobs
from pbg_ray.importer.demo import demo_checkpoint_path
from tests.util import config_dict, joining_the_session, random_checkpoint, write_random_graph


def tiny_graph(root: Path, **overrides) -> dict:
    """The config dict of a tiny random graph written under root/data."""
    data = config_dict(root / "data", dimension=4, global_emb=False, **overrides)
    write_random_graph(ConfigSchema.from_dict(data), num_edges=40)
    return data


def pbg_module(path: Path, data: dict) -> Path:
    path.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    return path


def sigint_as_in_a_terminal() -> None:
    """Run in a command's process before it starts: Ctrl-C (SIGINT) interrupts it, as in a
    terminal, even where the tests run as a shell's background job, which inherits SIGINT
    ignored (and would pass that on to the command)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def command(name, args, cwd, **kwargs):
    return subprocess.Popen([sys.executable, "-m", f"pbg_ray.{name}", *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal, **kwargs)


def run(name, args, cwd, env=None):
    proc = command(name, args, cwd, env=env)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def assert_one_error_line(err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbg_ray: error: "), err[-2000:]
    for part in parts:
        assert part in lines[0]


@pytest.fixture
def workdir(tmp_path) -> Path:
    """An empty working directory for the command; it must stay empty."""
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.mark.parametrize("sig, line, status", [(signal.SIGINT, "pbg_ray: interrupted", 130),
                                               (signal.SIGTERM, "pbg_ray: terminated", 143)])
def test_a_stop_asked_within_stop_requests_interrupts_nothing_then_ends_the_command(
        tmp_path, sig, line, status):
    """Within stop_requests a signal only sets the stop event (what runs goes on to see it);
    leaving it ends the command as that signal ends one, and the handlers before it are back.
    (In a process of its own: a command's stop ends its process.)"""
    script = f"""
import os, signal, sys
from pbg_ray.cli import report_errors, stop_requests
before = {{s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}}

@report_errors
def serve_until_stopped():
    with stop_requests() as stop:
        os.kill(os.getpid(), {int(sig)})
        assert stop.wait(60)
        print("went on", flush=True)

try:
    serve_until_stopped()
finally:
    print({{s: signal.getsignal(s) for s in before}} == before, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (status, "went on\nTrue\n", line + "\n")


def test_a_stop_whose_cleanup_fails_still_ends_with_its_line_and_status(tmp_path):
    """Where ending what the command started fails (here kill_local_ray raises) in the
    deadline's thread, the command still ends then, with its line and the stop's status
    (not later, with another)."""
    script = """
import os, signal, time
from pbg_ray import cli

def broken():
    raise RuntimeError("cleanup failed")

cli.kill_local_ray = broken
cli.STOP_DEADLINE_S = 0.5

@cli.report_errors
def main():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except KeyboardInterrupt:  # work that does not unwind: the deadline ends the command
        time.sleep(30)

main()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (143, "pbg_ray: terminated\n")


def test_what_ray_writes_to_stderr_once_a_stop_is_asked_is_not_printed(tmp_path):
    """Once a command with a local Ray is asked to stop, what Ray writes to the process's
    stderr (its core worker's lines as the signal to the group ends its workers, written
    to fd 2 from C++) is not printed; the command's own lines are, its stop line last."""
    script = """
import os, signal, sys
from pbg_ray.cli import report_errors, stop_requests
from pbg_ray.config import RayConfig
from pbg_ray.runtime.connect import connect_ray

@report_errors
def serve_until_stopped():
    connect_ray(RayConfig(num_cpus=1))
    with stop_requests() as stop:
        os.write(2, b"ray before the stop\\n")
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(60)
        os.write(2, b"ray: Failed to push error to driver for task 1\\n")
        print("pbg_ray: ours", file=sys.stderr)

serve_until_stopped()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-3:] == ["ray before the stop", "pbg_ray: ours",
                                             "pbg_ray: terminated"], proc.stderr[-3000:]


def test_a_mistyped_key_in_a_python_config_file_is_one_line_naming_it(tmp_path, workdir):
    data = tiny_graph(tmp_path)
    module = pbg_module(tmp_path / "config.py", dict(data, lrr=0.1))
    code, _, err = run("train", [module], workdir)
    assert code == 2
    assert_one_error_line(err, f"{module}: unknown key 'lrr' (did you mean 'lr'?)")
    assert not list(workdir.iterdir()) and not Path(data["checkpoint_path"]).exists()


@pytest.mark.parametrize("key, value, message", [
    ("dimesion", 4, "unknown key 'dimesion' (did you mean 'dimension'?)"),
    ("batch_size", "abc", "batch_size: expected an integer, got 'abc'"),
])
def test_a_mistake_in_a_yaml_graph_file_is_the_command_lines_line_naming_it(
        tmp_path, workdir, key, value, message):
    data = tiny_graph(tmp_path)
    graph = tmp_path / "conf" / "graph" / "mine.yaml"
    graph.parent.mkdir(parents=True)
    graph.write_text("# @package _global_\n" + yaml.safe_dump(dict(data, **{key: value})))
    code, _, err = run("train", ["--config-dir", tmp_path / "conf", "graph=mine"], workdir)
    assert code == 2
    assert_one_error_line(err, f"{graph}: {message}")
    assert not list(workdir.iterdir()) and not Path(data["checkpoint_path"]).exists()


def test_a_missing_init_path_stops_the_run_before_anything_is_written(tmp_path, workdir):
    data = tiny_graph(tmp_path)
    module = pbg_module(tmp_path / "config.py", data)
    code, _, err = run("train", [module, f"init_path={tmp_path / 'nowhere'}"], workdir)
    assert code == 2
    assert_one_error_line(err, f"init_path '{tmp_path / 'nowhere'}' holds no checkpoint")
    assert not list(workdir.iterdir()) and not Path(data["checkpoint_path"]).exists()


def test_an_error_inside_a_train_task_is_one_line_and_leaves_nothing(tmp_path, workdir,
                                                                      ray_session):
    data = tiny_graph(tmp_path)
    count_file = Path(data["entity_path"]) / "entity_count_item_0.txt"
    count_file.write_text("1\n")  # the item ids of the edges are now out of range
    module = pbg_module(tmp_path / "config.py", data)
    code, _, err = run("train", [module], workdir,
                       env=dict(os.environ, **joining_the_session(ray_session)))
    assert code == 2
    assert_one_error_line(err, "outside partition 0 of entity type 'item'")
    checkpoint = Path(data["checkpoint_path"])
    assert not list(workdir.iterdir())
    assert not checkpoint.exists() or not list(checkpoint.iterdir()), list(checkpoint.iterdir())


def test_a_truncated_embeddings_file_is_one_line_saying_how_to_go_on(tmp_path, workdir,
                                                                      ray_session):
    """eval and export name the file and the versions kept to go on from, with no Ray
    traces; the failed export leaves no output directory behind."""
    from pbg_ray.training.trainer import Trainer

    data = tiny_graph(tmp_path, num_epochs=2, checkpoint_preservation_interval=1)
    Trainer(ConfigSchema.from_dict(data)).run()
    damaged = Path(data["checkpoint_path"]) / "embeddings_user_0.v2.h5"
    os.truncate(damaged, damaged.stat().st_size // 2)
    module = pbg_module(tmp_path / "config.py", data)
    env = dict(os.environ, **joining_the_session(ray_session))
    way_on = (f"Versions kept in epoch_*/ of '{data['checkpoint_path']}': [1]. Read one "
              "(eval.version, export.version, serve.version, predict --version), or start a "
              f"run from one (init_path='{data['checkpoint_path']}/epoch_1'); else train again.")
    for name, args in (("eval", [f"eval.edge_paths=[{data['edge_paths'][0]}]"]),
                       ("export", [f"export.output={tmp_path / 'out'}", "export.format=parquet"])):
        code, _, err = run(name, [module, *args], workdir, env=env)
        assert code == 2
        lines = [line for line in err.splitlines() if "eval scores edges the model" not in line]
        assert_one_error_line("\n".join(lines), f"embeddings file '{damaged}' is not a readable "
                              "HDF5 file", way_on)
    assert not (tmp_path / "out").exists()
    shutil.rmtree(Path(data["checkpoint_path"]) / "epoch_1")
    code, _, err = run("eval", [module], workdir, env=env)
    assert "No other version of" in err and "train again, from init_path" in err


def test_train_tasks_larger_than_the_local_ray_are_refused_naming_the_key(tmp_path, workdir):
    """The local Ray that a command starts has no autoscaler: train tasks that ask for
    more CPUs than it has would wait for ever. The command stops at once with one line
    naming the key and the most it may be, and leaves nothing behind."""
    data = tiny_graph(tmp_path)
    module = pbg_module(tmp_path / "config.py", data)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code, _, err = run("train", [module, "ray.num_cpus=2", "ray.cpus_per_trainer=3"], workdir,
                       env=env)
    assert code == 2
    assert_one_error_line(err, "ray.cpus_per_trainer=3: each task asks for 3 CPUs, and no node",
                          "(the largest has 2). Set ray.cpus_per_trainer to at most 2 or start "
                          "the local Ray with more (ray.num_cpus).")
    checkpoint = Path(data["checkpoint_path"])
    assert not list(workdir.iterdir())
    assert not checkpoint.exists() or not list(checkpoint.iterdir()), list(checkpoint.iterdir())


def processes_mentioning(text: str):
    """Pids of live processes whose command line holds `text` (zombies have none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def train_until_a_version(tmp_path: Path, workdir: Path):
    """`python -m pbg_ray.train` of a tiny graph for 1000 epochs on a local Ray of its own
    (RAY_TMPDIR), in its own session (as a terminal's foreground job), once its first
    version is complete: (process, Ray's directory, config dict, arguments)."""
    data = tiny_graph(tmp_path, eval_fraction=0.0)
    module = pbg_module(tmp_path / "config.py", data)
    ray_tmp = tempfile.mkdtemp(prefix="pbg-cc-", dir="/tmp")  # Ray's socket paths stay short
    version_file = Path(data["checkpoint_path"]) / "checkpoint_version.txt"
    args = [module, "num_epochs=1000", "ray.num_cpus=1"]
    proc = command("train", args, workdir, env=dict(os.environ, RAY_TMPDIR=ray_tmp),
                   start_new_session=True)
    while not (version_file.is_file() and version_file.read_text().strip()):
        if proc.poll() is not None:
            pytest.fail(proc.communicate()[1][-3000:])
        time.sleep(0.1)
    return proc, ray_tmp, data, args


def stopped_train(proc, ray_tmp: str, data: dict, args, sig: int, group: bool):
    """Send `sig` to the command's whole process group (as Ctrl-C in a terminal, `timeout`,
    `kill -- -PGID`: the local Ray's processes get it too) or to the command alone; assert
    its one line says the version that is complete and how to resume, and that no process
    of its Ray is left. (exit status, the complete version)."""
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    version = int((Path(data["checkpoint_path"]) / "checkpoint_version.txt").read_text())
    progress = re.compile(r"epoch \d+/1000 path 1/1 chunk 1/1: \d+ buckets, .* edges/s, loss ")
    lines = [line for line in err.splitlines() if not progress.match(line)]
    word = "terminated" if sig == signal.SIGTERM else "interrupted"
    resume = f"python -m pbg_ray.train {' '.join(map(str, args))}"
    assert lines == [f"pbg_ray: {word}; version {version} of {data['checkpoint_path']} is "
                     f"complete; rerun `{resume}` to resume"], err[-3000:]
    # The command reaped what it killed; what Ray still ends on its own goes quickly.
    deadline = time.monotonic() + 30
    while processes_mentioning(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(ray_tmp), "Ray processes left behind"
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc.returncode, version


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_no_process_left_and_the_rerun_resumes(tmp_path, workdir,
                                                                              ray_session):
    proc, ray_tmp, data, args = train_until_a_version(tmp_path, workdir)
    code, version = stopped_train(proc, ray_tmp, data, args, signal.SIGINT, group=True)
    assert code == 130

    code, out, err = run("train", [args[0], f"num_epochs={version + 1}"], workdir,
                         env=dict(os.environ, **joining_the_session(ray_session)))
    assert code == 0, err[-3000:]
    assert f"resuming from version {version} of {version + 1} in {data['checkpoint_path']}" in err
    assert json.loads(out.splitlines()[-1])["version"] == version + 1
    assert not list(workdir.iterdir())  # no outputs/, .hydra or log file


@pytest.mark.slow
@pytest.mark.parametrize("group", [True, False], ids=["to-its-group", "to-it-alone"])
def test_sigterm_stops_train_with_its_line_and_no_process_left(tmp_path, workdir, group):
    """SIGTERM to the whole process group (`timeout`, a shell's job control, `kill --
    -PGID`: Ray's GCS and raylet end at once with the command) or to the command alone
    (a service manager): the same line as Ctrl-C's, status 143, not Ray's stack dump."""
    proc, ray_tmp, data, args = train_until_a_version(tmp_path, workdir)
    code, _ = stopped_train(proc, ray_tmp, data, args, signal.SIGTERM, group)
    assert code == 143


def test_a_stop_whose_work_does_not_unwind_ends_the_command_at_the_deadline(tmp_path):
    """Where the command's work does not end once asked to stop (a call waiting on a Ray
    whose GCS is gone), it ends at STOP_DEADLINE_S all the same: its line said, what it
    started killed, its status."""
    script = """
import os, signal, subprocess, sys, time
from pbg_ray import cli
cli.STOP_DEADLINE_S = 0.5

@cli.report_errors
def main():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    with cli.stop_note(lambda: "version 3 is complete"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(600)
        except KeyboardInterrupt:
            time.sleep(600)

main()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (143, "pbg_ray: terminated; version 3 is complete\n")
    child = int(proc.stdout)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_tune_on_a_pbg_config_file_searches_the_default_space_beside_its_checkpoint(
        tmp_path, workdir, ray_session):
    """The default space's keys that act on the config are sampled (margin doesn't with
    softmax: a line says so; nor is the config's own dimension, 4, among the space's: a
    line says that too), and the output is a line per trial result, the metric first,
    then how the trials ended and by which rule the best is picked, then the best."""
    data = tiny_graph(tmp_path, eval_fraction=0.0, eval_num_batch_negs=10, loss_fn="softmax",
                      eval_num_uniform_negs=10, eval_edge_paths=[str(tmp_path / "valid")])
    write_random_graph(ConfigSchema.from_dict(dict(data, edge_paths=data["eval_edge_paths"])),
                       num_edges=20, seed=1)
    module = pbg_module(tmp_path / "config.py", data)
    code, out, err = run("tune", [module, "tune.num_samples=2", "num_epochs=2"], workdir,
                         env=dict(os.environ, **joining_the_session(ray_session)))
    assert code == 0, err[-3000:]
    lines = out.splitlines()
    given = ConfigSchema.from_dict(data)  # the first trial's lr and dimension (config_first)
    own = f"lr={given.lr:.4g} dimension={given.dimension}"
    assert lines[:4] == [
        "2 trials of lr, dimension: each reports mrr (on eval_edge_paths) after each of its 2 "
        "epochs; ASHA stops the poor ones early (from epoch 1 on)",
        f"the first trial trains the config's own values: lr={given.lr} "
        f"dimension={given.dimension} (tune.config_first)",
        f"dimension={given.dimension} is outside its search space {{choice: [50, 100, 200]}}: "
        "the first trial alone trains it, the others nothing near it; a space around it "
        "searches what the config sets (conf/tune/quality.yaml: around the quality recipe)",
        "margin is left out of the search: it changes nothing here (the ranking loss's margin, "
        "and loss_fn=softmax)"], out
    results = [re.fullmatch(r"trial (\w+) epoch (\d)/2: mrr=(\S+)  loss=\S+  \| "
                            r"(lr=\S+ dimension=\d+)( \(stopped early by ASHA\))?",
                            line) for line in lines[4:-5]]
    assert all(results), out
    first = min(r[1] for r in results)
    assert all((r[4] == own) == (r[1] == first) for r in results), out
    assert all(re.fullmatch(r"lr=\S+ dimension=(50|100|200)", r[4]) for r in results
               if r[1] != first), out
    epochs = {}  # trial -> its epochs reported, in order
    for result in results:
        epochs.setdefault(result[1], []).append(int(result[2]))
    assert len(epochs) == 2 and all(e == list(range(1, len(e) + 1)) for e in epochs.values())
    stopped = {r[1] for r in results if r[5]}
    assert stopped == {t for t, e in epochs.items() if len(e) < 2}, out  # said where it stopped
    assert lines[-5] == (f"2 trials: {2 - len(stopped)} ran all 2 epochs, {len(stopped)} "
                         "stopped early; the best has the highest mrr at its last epoch (which "
                         "its checkpoint holds)")
    best = json.loads(lines[-1])
    last_mrr = {r[1]: float(r[3]) for r in results}  # each trial's last line
    assert best["trial_id"] == max(last_mrr, key=last_mrr.get)
    assert lines[-4].startswith(f"best trial {best['trial_id']} after epoch "
                                f"{epochs[best['trial_id']][-1]}: mrr=")
    assert lines[-3] == "best config: " + " ".join(f"{k}={v}" for k, v in best["config"].items())
    assert list(best["config"]) == ["lr", "dimension"]
    assert lines[-2] == f"best checkpoint: {best['checkpoint_path']} (version {best['version']})"
    # Neither Ray's line per Tune checkpoint nor the trials' pass lines.
    assert "Checkpoint successfully created" not in err and "buckets," not in err, err[-3000:]
    # Two trials, each beside the configured checkpoint_path: the first with the config's
    # own lr and dimension, the second with the default space's keys that act sampled;
    # margin is the file's.
    trials = sorted(tmp_path.glob("data/checkpoints-*/config.json"))  # in trial order
    assert len(trials) == 2 and best["checkpoint_path"] in {str(t.parent) for t in trials}
    sampled = [{k: json.loads(t.read_text())[k] for k in ("lr", "dimension", "margin")}
               for t in trials]
    assert (sampled[0]["lr"], sampled[0]["dimension"]) == (given.lr, given.dimension)
    assert 0.01 <= sampled[1]["lr"] <= 0.5 and sampled[1]["dimension"] in (50, 100, 200)
    assert all(s["margin"] == 0.1 for s in sampled)
    assert (tmp_path / "data" / "checkpoints-tune").is_dir()
    assert not Path(data["checkpoint_path"]).exists() and not list(workdir.iterdir())


def test_tune_picks_a_search_space_of_ones_own_by_name(tmp_path, workdir):
    """tune=<name> selects <config dir>/tune/<name>.yaml, for a PBG config file too."""
    spaces = tmp_path / "my_conf" / "tune"
    spaces.mkdir(parents=True)
    (spaces / "narrow.yaml").write_text(
        "search_space:\n  lr: {choice: [0.02, 0.03]}\nnum_samples: 3\nscheduler: fifo\n")
    module = pbg_module(tmp_path / "config.py", tiny_graph(tmp_path))
    code, out, err = run("tune", [module, "--config-dir", tmp_path / "my_conf", "tune=narrow",
                                  "--cfg", "job"], workdir)
    assert code == 0, err[-2000:]
    tune = yaml.safe_load(out)["tune"]
    assert tune["search_space"] == {"lr": {"choice": [0.02, 0.03]}}, out[-2000:]
    assert (tune["num_samples"], tune["scheduler"]) == (3, "fifo")
    code, out, err = run("tune", [module, "--config-dir", tmp_path / "my_conf", "tune=wide"],
                         workdir)
    assert code != 0 and "wide" in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert not list(workdir.iterdir())


def test_the_demo_checkpoint_path_is_one_place_that_predict_and_plot_default_to(tmp_path,
                                                                               monkeypatch):
    from hydra import compose, initialize_config_module

    from pbg_ray import plot, predict

    monkeypatch.setenv("PBG_RAY_CACHE", str(tmp_path / "cache"))
    with initialize_config_module("pbg_ray.conf", version_base=None):
        cfg = compose("config")
    assert cfg.checkpoint_path == demo_checkpoint_path() == str(tmp_path / "cache" /
                                                                "demo-v1-checkpoints")
    assert predict.parse_args(["top-rhs", "user_1", "likes"]).checkpoint_path == \
        demo_checkpoint_path()
    assert predict.parse_args(["--tag", "v1", "neighbors", "user_1"]).checkpoint_path == \
        demo_checkpoint_path()
    assert predict.parse_args(["model", "score", "a", "b", "c"]).checkpoint_path == "model"
    with pytest.raises(SystemExit):  # no training stats there: plot's usual error
        plot.main([])


def test_a_command_without_a_config_file_says_it_uses_the_demo(tmp_path, workdir):
    cache = tmp_path / "cache"
    code, _, err = run("eval", [], workdir, env=dict(os.environ, PBG_RAY_CACHE=str(cache)))
    assert code == 2
    assert err.splitlines()[0] == (
        f"pbg_ray: no config file given: pbg_ray.eval uses the built-in demo graph "
        f"({cache / 'demo-v1'}) and its checkpoint ({cache / 'demo-v1-checkpoints'})")
    assert "holds no checkpoint" in err.splitlines()[1]
    data = tiny_graph(tmp_path)
    code, _, err = run("eval", [pbg_module(tmp_path / "config.py", data)], workdir)
    assert code == 2 and "demo" not in err


def test_sweep_jobs_are_named_by_their_swept_values_alone():
    argv = ["-m", "lr=0.01,0.1", "ray.num_cpus=1", "dimension=50,100"]
    assert name_sweep_jobs(argv, argv[1:]) == [
        "hydra.job.config.override_dirname.exclude_keys=['ray.num_cpus']"]
    assert name_sweep_jobs(argv[1:], argv[1:]) == []  # a single run


def test_pbg_keys_are_warned_about_in_a_users_file_not_in_a_checkpoints_config(tmp_path,
                                                                              workdir):
    """A torchbiggraph checkpoint's config.json carries PBG's keys for distributing work:
    reading it warns of none (they describe the run that wrote it). The user's own config
    file is warned about, once, in the project's voice, by predict too."""
    data = tiny_graph(tmp_path)
    random_checkpoint(ConfigSchema.from_dict(data))
    written = Path(data["checkpoint_path"]) / "config.json"  # as torchbiggraph writes it
    written.write_text(json.dumps(dict(
        json.loads(written.read_text()), background_io=False, num_machines=1,
        num_partition_servers=-1, distributed_init_method=None,
        distributed_tree_init_order=True)))
    module = pbg_module(tmp_path / "config.py", dict(data, num_machines=1))
    code, out, err = run("predict", [module, "neighbors", "user-0-1", "-k", "2"], workdir)
    assert code == 0, err[-2000:]
    assert err.splitlines() == [f"pbg_ray: warning: {module}: PBG key 'num_machines' is "
                                "ignored: the Ray cluster decides the machines (ray.address)"]
    assert len(json.loads(out)["hits"]) == 2
