"""The user's own program (``--script``, ``--package --module``): checks on the driver, the
environment every rank gets (Vertex AI's contract), dependencies, runs on a cluster.

The runs across nodes share one 2-node cluster (the module's ``two_nodes``): this package with a
local dependency, a built package (tests/test_package_archives.py checks them on the driver) and a
user workload file (tests/test_user_workloads.py's), each shipped to both nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from launcher.cli.main import main
from launcher.driver import archives
from launcher.driver.dependencies import declared_requirements, setup_py_dependencies
from launcher.driver.program import from_package
from launcher.errors import UserError
from launcher.worker import deps, vertex
from launcher.worker.deps import WORKING_DIR_VAR
from test_user_workloads import SHIPPED, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "trainer_package")


def package(tmp_path, files: dict[str, str]) -> str:
    folder = tmp_path / "pkg"
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(folder)


# -- checks before anything starts -----------------------------------------------------------

def test_the_example_package_passes_the_checks_and_declares_its_dependencies():
    program = from_package(EXAMPLE, "trainer.task")
    assert (program.kind, program.folder, program.target) == ("module", EXAMPLE, "trainer.task")
    assert program.requirements == ("cloudml-hypertune",) and program.sources == ("setup.py",)
    assert program.command()[1:] == ["-m", "trainer.task"]
    assert program.runtime_env()["working_dir"] == EXAMPLE


@pytest.mark.parametrize("files, module, message", [
    ({}, "trainer.task", "no trainer/task.py"),
    ({"trainer/__init__.py": "", "trainer/task.py": "def f(:\n"}, "trainer.task",
     "trainer/task.py line 1: syntax error"),
    ({"trainer/__init__.py": "", "trainer/task.py": "from trainer import model\n",
      "trainer/model.py": "import os\nimport not_installed_anywhere\n"}, "trainer.task",
     "trainer/model.py line 2 imports not_installed_anywhere"),
    ({"trainer/__init__.py": "", "trainer/task.py": "from . import helpers\n",
      "trainer/helpers.py": "x = (\n"}, "trainer.task", "trainer/helpers.py line 1: syntax error"),
    ({"trainer/task.py": ""}, "trainer-task", "not a dotted module name"),
    ({"trainer/task.py": "", "requirements.txt": "./deps/missing-1.0-py3-none-any.whl\n"}, "trainer.task",
     "requirements.txt line 1: ./deps/missing-1.0-py3-none-any.whl: no such file"),
    ({"trainer/task.py": "", "requirements.txt": "numpy\n-e ./somewhere\n"}, "trainer.task",
     "line 2: '-e ./somewhere': nested requirement files and editable installs"),
    ({"trainer/task.py": "", "pyproject.toml": "[project\n"}, "trainer.task", "not valid TOML"),
])
def test_a_package_that_cannot_run_is_one_clear_error(tmp_path, files, module, message):
    folder = package(tmp_path, files) if files else str(tmp_path)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        from_package(folder, module)


def test_imports_guarded_or_declared_are_not_refused(tmp_path):
    folder = package(tmp_path, {
        "trainer/task.py": """
            import json
            try:
                import optional_thing
            except ImportError:
                optional_thing = None

            def main():
                import only_when_called
        """,
    })
    assert from_package(folder, "trainer.task").requirements == ()
    (tmp_path / "pkg" / "trainer" / "task.py").write_text("import yaml_under_another_name\n")
    (tmp_path / "pkg" / "requirements.txt").write_text("PyYAML\n")  # pip decides, on the node
    assert from_package(folder, "trainer.task").requirements == ("PyYAML",)


def test_requirements_from_each_kind_of_declaration(tmp_path):
    folder = tmp_path / "p"
    (folder / "deps").mkdir(parents=True)
    (folder / "deps" / "extra-1.0-py3-none-any.whl").write_bytes(b"")
    (folder / "requirements.txt").write_text("# pinned\nnumpy==2.4.6  # comment\n\n./deps/extra-1.0-py3-none-any.whl\n")
    (folder / "setup.py").write_text("from setuptools import setup\nsetup(name='t', install_requires=['pyyaml', "
                                     "'numpy==2.4.6'])\n")
    reqs, sources = declared_requirements(str(folder))
    assert reqs == ["numpy==2.4.6", f"{WORKING_DIR_VAR}/deps/extra-1.0-py3-none-any.whl", "pyyaml"]
    assert sources == ["requirements.txt", "setup.py"]
    # install_requires computed at build time: pip builds the package on the node to find them
    (folder / "setup.py").write_text("from setuptools import setup\nsetup(name='t', install_requires=deps())\n")
    assert declared_requirements(str(folder))[0][-1] == WORKING_DIR_VAR
    (folder / "pyproject.toml").write_text("[project]\nname = 't'\ndependencies = ['tqdm>=4']\n")
    os.remove(folder / "requirements.txt")
    assert declared_requirements(str(folder)) == (["tqdm>=4"], ["pyproject.toml"])
    outside = tmp_path / "elsewhere.whl"
    outside.write_bytes(b"")
    (folder / "requirements.txt").write_text(f"{outside}\n")
    with pytest.raises(UserError, match="is outside .* so other nodes would not have it"):
        declared_requirements(str(folder))


@pytest.mark.parametrize("argv, message", [
    (["--package", "nowhere", "--module", "trainer.task"], "--package nowhere: no such folder"),
    (["--package", EXAMPLE], "--module is missing"),
    (["--module", "trainer.task"], "--package is missing"),
    (["--script", "x.py", "--package", EXAMPLE, "--module", "trainer.task"], "name two programs"),
    (["--package", EXAMPLE, "--module", "trainer.nothing"], "no trainer/nothing.py"),
    (["--no-job-dir"], "--no-job-dir applies to --script or --package runs only"),
])
def test_bad_program_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = main(["run", *argv, "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "runs").exists()


def test_a_folder_over_the_size_limit_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    folder = package(tmp_path, {"trainer/__init__.py": "", "trainer/task.py": "print(1)\n"})
    with open(os.path.join(folder, "data.bin"), "wb") as f:
        f.write(os.urandom(3 * 2**20))
    monkeypatch.setenv("LAUNCHER_CODE_LIMIT_MB", "1")
    code = main(["run", "--package", folder, "--module", "trainer.task", "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "the package's folder" in err[0] and "over 1 MiB" in err[0] and "data.bin (3 MiB)" in err[0]


def test_dependencies_install_once_per_node_on_top_of_its_environment(tmp_path):
    folder = tmp_path / "pkg"
    wheel = build_wheel(tmp_path, str(folder / "deps"))
    reqs = [f"{WORKING_DIR_VAR}/deps/{wheel}", "numpy"]  # numpy: already here, so not installed again
    key = deps.env_key(reqs, str(folder))
    python, installed = deps.ensure(reqs, key, str(folder), root=str(tmp_path / "envs"))
    assert installed and python.startswith(str(tmp_path / "envs"))
    probe = subprocess.run([python, "-c", "import launcher_test_extra, numpy, torch; print(launcher_test_extra.MARK,"
                            " numpy.__file__)"], capture_output=True, text=True, check=True).stdout.split()
    assert probe[0] == "extra-4.2" and not probe[1].startswith(str(tmp_path))  # the node's own numpy
    assert deps.ensure(reqs, key, str(folder), root=str(tmp_path / "envs")) == (python, False)  # cached
    # a changed wheel is a new environment; a broken one is pip's reason, and nothing half built stays
    (folder / "deps" / wheel).write_bytes(b"not a zip file")
    broken = deps.env_key(reqs, str(folder))
    assert broken != key
    with pytest.raises(deps.DependencyError, match=r"Wheel .launcher-test-extra. located at .* is invalid"):
        deps.ensure(reqs, broken, str(folder), root=str(tmp_path / "envs"))
    assert not [d for d in os.listdir(tmp_path / "envs") if d.startswith(broken) and not d.endswith(".lock")]


# -- the environment each rank gets -------------------------------------------------------------

def test_vertex_variables_for_each_rank():
    addresses = ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"]
    assert vertex.cluster_spec(addresses, 0) == {
        "cluster": {"workerpool0": ["10.0.0.1:2222"], "workerpool1": ["10.0.0.2:2222", "10.0.0.3:2222"]},
        "environment": "cloud", "task": {"type": "workerpool0", "index": 0}}
    assert vertex.cluster_spec(addresses, 2)["task"] == {"type": "workerpool1", "index": 1}
    assert vertex.cluster_spec(addresses[:1], 0)["cluster"] == {"workerpool0": ["10.0.0.1:2222"]}
    tf = vertex.tf_config(addresses, 1, trial="3")
    assert tf == {"cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]},
                  "task": {"type": "worker", "index": 0, "trial": "3"}, "environment": "cloud"}
    assert vertex.tf_addresses(json.dumps(tf)) == addresses
    assert vertex.output_dirs("gs://b/runs/r1") == {
        "AIP_MODEL_DIR": "gs://b/runs/r1/model/", "AIP_CHECKPOINT_DIR": "gs://b/runs/r1/checkpoints/",
        "AIP_TENSORBOARD_LOG_DIR": "gs://b/runs/r1/logs/"}


def test_hypertune_reports_are_read_back_as_numbers(tmp_path, monkeypatch):
    import hypertune

    path = tmp_path / "hp" / "output.metrics"
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "7")
    tuner = hypertune.HyperTune()
    tuner.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy", metric_value=0.5, global_step=10)
    first = vertex.read_metrics(str(path))
    assert [(e["accuracy"], e["global_step"], e["trial"]) for e in first] == [(0.5, 10, 7)]
    tuner.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy", metric_value=0.75, global_step=20)
    new = vertex.read_metrics(str(path), after=first[-1]["timestamp"])  # the library rewrites the whole file
    assert [vertex.metric_values(e) for e in new] == [{"accuracy": 0.75}]
    with open(path, "a") as f:
        f.write('{"accuracy": "0.9", "timest')  # half written: skipped, read next time
    assert len(vertex.read_metrics(str(path))) == 2


# -- on this machine's Ray -------------------------------------------------------------------------

def build_wheel(tmp_path, dest: str) -> str:
    """launcher-test-extra, a tiny pure-Python distribution, built into a wheel in ``dest``: a
    package's local dependency (built offline: nothing it needs comes from an index)."""
    src = tmp_path / "extra-src"
    (src / "launcher_test_extra").mkdir(parents=True)
    (src / "launcher_test_extra" / "__init__.py").write_text("MARK = 'extra-4.2'\n")
    (src / "setup.py").write_text("from setuptools import setup\nsetup(name='launcher-test-extra', version='4.2', "
                                  "packages=['launcher_test_extra'])\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-q",
                    "-w", dest, str(src)], check=True, capture_output=True)
    (wheel,) = os.listdir(dest)
    return wheel


@pytest.mark.integration
def test_a_requirement_that_cannot_be_installed_is_one_line_before_training(warm_head, tmp_path):
    """A `launcher run` process on the session's warm head (its own local Ray would add a start
    and a stop), which gets the launch's settings with the job: the install ran in this test's
    LAUNCHER_ENV_CACHE."""
    pkg = package(tmp_path, {"trainer/__init__.py": "", "trainer/task.py": "print('trained', flush=True)\n"})
    os.makedirs(os.path.join(pkg, "deps"))
    with open(os.path.join(pkg, "deps", "broken-1.0-py3-none-any.whl"), "wb") as f:
        f.write(b"this is not a zip file")
    with open(os.path.join(pkg, "requirements.txt"), "w") as f:
        f.write("./deps/broken-1.0-py3-none-any.whl\n")
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--package", pkg, "--module", "trainer.task",
                           "--workers", "1", "--storage", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LAUNCHER_ENV_CACHE": str(tmp_path / "envs")})
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert err[-1].startswith("error: the dependencies from requirements.txt could not be installed"), err
    assert "trained" not in done.stdout + done.stderr
    assert [n for n in os.listdir(tmp_path / "envs") if n.endswith(".lock")]  # and nothing half built there
    assert not [n for n in os.listdir(tmp_path / "envs") if not n.endswith(".lock")]


REPORTING_TASK = '''
import argparse, os
import hypertune

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--job-dir")
args = parser.parse_args()
tuner = hypertune.HyperTune()
for epoch in range(1, args.epochs + 1):
    print(f"training epoch {epoch}", flush=True)
    tuner.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy", metric_value=0.5 + epoch / 10,
                                              global_step=10 * epoch)
    tuner.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="loss", metric_value=1.0 / epoch,
                                              global_step=10 * epoch)
'''


@pytest.mark.integration
def test_package_and_job_file_runs_keep_stdout_for_the_summary_and_list_their_epochs(warm_head, tmp_path, capsys):
    """Both runs are `launcher run` processes: what their stdout holds is the point. `launcher
    runs` reads only the storage, so it runs in this process."""
    pkg = package(tmp_path, {"trainer/__init__.py": "", "trainer/task.py": REPORTING_TASK})
    storage = str(tmp_path / "runs")
    # --package with --json: stdout is one JSON object; the ranks' lines are progress, on stderr
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--package", pkg, "--module", "trainer.task",
                           "--workers", "2", "--storage", storage, "--name", "pkg", "--json", "--", "--epochs", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["status"] == "succeeded" and summary["epochs_completed"] == 3, summary
    assert summary["metrics"] == pytest.approx({"accuracy": 0.8, "loss": 1 / 3})  # both tags, not the last only
    for r in range(2):
        assert f"[rank {r}] training epoch 3" in done.stderr, done.stderr[-3000:]
    # a job file (--config), without --json: stdout holds the summary alone, no rank's line
    job = tmp_path / "job.yaml"
    job.write_text(f"trainingInput:\n  scaleTier: BASIC\n  packageUris: [{pkg}]\n  pythonModule: trainer.task\n"
                   f"  args: [--epochs, '4']\n  jobDir: {storage}/job\n")
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--config", str(job)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("run job: succeeded") and "[rank" not in done.stdout, done.stdout
    assert "[rank 0] training epoch 4" in done.stderr
    assert "epochs 4 (by its reports)" in done.stdout
    # `launcher runs`: each with the epochs it trained and its reported metrics
    capsys.readouterr()
    assert main(["runs", "--storage", storage, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows["pkg"]["epochs"], rows["job"]["epochs"]) == (3, 4), rows
    assert rows["job"]["metrics"] == pytest.approx({"accuracy": 0.9, "loss": 0.25})
    assert main(["runs", "--storage", storage]) == 0
    table = capsys.readouterr().out
    line = next(x for x in table.splitlines() if x.startswith("job "))
    assert line.split()[3] == "4" and "loss 0.2500  accuracy 0.9000" in line, table


# -- on a 2-node cluster -----------------------------------------------------------------------------
# Runs across nodes: this package with a local dependency, a built package (sdist, by path and by
# gs:// URI) and a user workload file, each shipped to both nodes. They share one cluster, started
# once for the module (three tests in three modules each started and stopped one of their own: a
# head and two nodes, each with its raylet and agents). They come last, so it stops right after them.

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A Ray cluster on this machine: a head without CPUs and two 1-CPU nodes, so the 2 workers of a
    run are on two nodes. Its nodes see none of this machine's pip options (PIP_*): only what a
    launch passes on reaches their pip. Their overlay environments (LAUNCHER_ENV_CACHE, read
    from the nodes' own environment) go to ``envs``. Yields (address, envs)."""
    from ray.cluster_utils import Cluster

    envs = str(tmp_path_factory.mktemp("node-envs"))
    with pytest.MonkeyPatch.context() as mp:  # only while its processes start: they keep what they got
        for name in deps.pip_env():
            mp.delenv(name)
        mp.setenv("LAUNCHER_ENV_CACHE", envs)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            for _ in range(2):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
    try:
        yield cluster.address, envs
    finally:
        cluster.shutdown()


EXTRA = '''
import launcher_test_extra, json, os, sys
print("extra", launcher_test_extra.MARK, "job-dir", sys.argv[sys.argv.index("--job-dir") + 1], flush=True)
print("cluster-spec", os.environ["CLUSTER_SPEC"], flush=True)
print("dirs", os.environ["AIP_MODEL_DIR"], os.environ["AIP_CHECKPOINT_DIR"], flush=True)
'''


@pytest.mark.integration
def test_the_example_package_runs_on_two_nodes_with_a_local_dependency(two_nodes, tmp_path, capsys):
    address, _ = two_nodes
    pkg = tmp_path / "trainer_package"
    shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheel = build_wheel(tmp_path, str(pkg / "deps"))
    (pkg / "requirements.txt").write_text(f"./deps/{wheel}\n")
    task = pkg / "trainer" / "task.py"
    task.write_text(task.read_text().replace("\nimport hypertune\n", "\nimport hypertune\n" + EXTRA))
    cwd, storage = tmp_path / "elsewhere", str(tmp_path / "runs")
    cwd.mkdir()
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--package", str(pkg), "--module",
                           "trainer.task", "--workers", "2", "--address", address, "--storage", storage,
                           "--name", "pkg", "--json", "--", "--epochs", "2"],
                          cwd=cwd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    run_dir = os.path.join(storage, "pkg")
    assert summary["status"] == "succeeded" and summary["exit_codes"] == {"0": 0, "1": 0}, summary
    assert summary["metrics"]["accuracy"] > 0.8 and summary["workload"] == "module:trainer.task"
    assert summary["steps_completed"] == 2 * (1437 // 64)
    assert "installing the dependencies from requirements.txt and setup.py on 3 node(s)" in done.stderr
    specs = {}
    for r in range(2):
        assert f"[rank {r}] extra extra-4.2 job-dir {run_dir}" in done.stderr, done.stderr[-3000:]
        line = next(x for x in done.stderr.splitlines() if x.startswith(f"[rank {r}] cluster-spec "))
        specs[r] = json.loads(line.split("cluster-spec ", 1)[1])
        assert f"[rank {r}] dirs {run_dir}/model/ {run_dir}/checkpoints/" in done.stderr
    assert specs[0]["task"] == {"type": "workerpool0", "index": 0}
    assert specs[1]["task"] == {"type": "workerpool1", "index": 0}
    assert specs[0]["cluster"] == specs[1]["cluster"] and len(specs[0]["cluster"]["workerpool1"]) == 1
    assert os.path.getsize(os.path.join(run_dir, "model", "model.pt")) > 0  # exported to AIP_MODEL_DIR
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "checkpoint.pt"))
    # a run like any other: its log lists it, with the program's own reported metric
    capsys.readouterr()
    assert main(["runs", "--storage", storage, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "succeeded" and row["workload"] == "module:trainer.task" and "accuracy" in row["metrics"]


ARCHIVE_EXTRA = '''
import launcher_test_extra, trainer
print("extra", launcher_test_extra.MARK, "trainer-from", os.path.dirname(trainer.__file__), flush=True)
'''


def build_sdist(tmp_path) -> str:
    """The example trainer package, needing launcher-test-extra, as `python setup.py sdist` builds it."""
    src = tmp_path / "trainer-src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__"))
    setup = src / "setup.py"
    setup.write_text(setup.read_text().replace('install_requires=["cloudml-hypertune"]',
                                               'install_requires=["cloudml-hypertune", "launcher-test-extra"]'))
    task = src / "trainer" / "task.py"
    task.write_text(task.read_text().replace("\nimport hypertune\n", "\nimport hypertune\n" + ARCHIVE_EXTRA))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src, check=True,
                   capture_output=True)
    return str(tmp_path / "dist" / "trainer-0.1.tar.gz")


@pytest.mark.integration
@pytest.mark.gcs
def test_an_sdist_by_path_then_by_gs_uri_trains_on_two_nodes_and_resumes(two_nodes, tmp_path, gcs, bucket,
                                                                         monkeypatch):
    """A built package (tests/test_package_archives.py checks them on the driver): installed on every
    node with the driver's PIP_* options, run from the installed package, and resumed when the
    same archive comes by gs:// URI."""
    address, envs = two_nodes
    _, client = gcs
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))  # the fetched archive, the shipped folder
    wheels = tmp_path / "wheels"
    build_wheel(tmp_path, str(wheels))
    sdist = build_sdist(tmp_path)
    assert archives.open_archive(sdist, sdist).declared_requirements(setup_py_dependencies) == \
        ["cloudml-hypertune", "launcher-test-extra"]  # a real sdist's PKG-INFO
    client.bucket(bucket).blob("code/trainer-0.1.tar.gz").upload_from_filename(sdist)
    # The nodes never see this machine's pip options (two_nodes): only what the launcher passes on
    # finds the dependency, and nothing ever reaches for the network.
    for name in deps.pip_env():
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    env = {**os.environ, "PIP_FIND_LINKS": str(wheels)}
    storage, run_dir = str(tmp_path / "runs"), str(tmp_path / "runs" / "arc")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    runs = []
    for package, epochs in ((sdist, 1), (f"gs://{bucket}/code/trainer-0.1.tar.gz", 2)):
        runs.append(subprocess.run(
            [sys.executable, "-m", "launcher", "run", "--package", package, "--module", "trainer.task",
             "--workers", "2", "--address", address, "--storage", storage, "--name", "arc", "--json",
             "--", "--epochs", str(epochs)], cwd=cwd, capture_output=True, text=True, timeout=400, env=env))
        assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
    first, second = runs
    per_epoch = 1437 // 64
    for done, steps, accuracy in ((first, per_epoch, 0.2), (second, 2 * per_epoch, 0.8)):
        summary = json.loads(done.stdout)
        assert summary["status"] == "succeeded" and summary["exit_codes"] == {"0": 0, "1": 0}, summary
        assert summary["workload"] == "module:trainer.task (trainer-0.1.tar.gz)"
        assert summary["steps_completed"] == steps and summary["metrics"]["accuracy"] > accuracy, summary
        for r in range(2):  # the dependency found through the driver's PIP_FIND_LINKS; the installed trainer
            line = next(x for x in done.stderr.splitlines() if x.startswith(f"[rank {r}] extra extra-4.2 "))
            assert line.split("trainer-from ")[1].startswith(envs), line
    assert "installing trainer-0.1.tar.gz and its dependencies on 3 node(s)" in first.stderr
    assert "(installed on " in first.stderr and "(already there)" in second.stderr  # kept for later launches
    assert f"resumed from step {per_epoch} of {2 * per_epoch}" in second.stderr
    assert os.path.exists(os.path.join(run_dir, "model", "model.pt"))
    with open(os.path.join(run_dir, "launches.jsonl")) as f:
        launches = [json.loads(line)["spec"]["program"]["packages"] for line in f if '"start"' in line]
    assert launches == [[sdist], [f"gs://{bucket}/code/trainer-0.1.tar.gz"]]


@pytest.mark.integration
def test_user_workload_is_shipped_to_a_cluster_and_resumes_mid_epoch(two_nodes, tmp_path):
    """A user workload file (tests/test_user_workloads.py's NOTED, launched by a path relative to the
    current folder) goes to the nodes with the job, and a run stopped with Ctrl-C in the middle of
    an epoch resumes there at its last checkpoint and trains to the end. (That such a resume ends
    with the very weights of an uninterrupted run, NOTED on a multi-node cluster, is checked by
    tests/chaos/test_preemption_chaos.py against its own uninterrupted run; a third launch here
    to compare with would check it again.)"""
    import signal
    import time

    from launcher.storage import Storage, complete_checkpoints

    address, _ = two_nodes
    path = write(tmp_path / "code", SHIPPED)
    cwd, markers, storage = tmp_path / "cwd", tmp_path / "markers", str(tmp_path / "runs")
    for folder in (cwd, markers):
        folder.mkdir()
    base = [sys.executable, "-m", "launcher", "run", "--workload", os.path.relpath(path, cwd) + ":NOTED",
            "--epochs", "4", "--seed", "5", "--checkpoint-every-steps", "5", "--keep-checkpoints", "30",
            "--data", str(markers),
            "--storage", storage, "--address", address, "--json"]

    def launch(name: str, *extra: str) -> dict:
        done = subprocess.run(base + ["--name", name, *extra], cwd=cwd, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    # The same run, stopped (Ctrl-C) in the middle of an epoch, then launched again. The
    # workers hold after step 27, so the last checkpoint before the stop is step 25 (epoch 1,
    # 6 steps in) however long the stop takes to land.
    proc = subprocess.Popen(base + ["--name", "stopped", "--param", "hold_after=27"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        done = complete_checkpoints(Storage.resolve(storage), "stopped")
        if any(m.global_step >= 25 for m, _ in done):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    stopped = json.loads(out)
    assert stopped["status"] == "cancelled" and stopped["steps_completed"] < 4 * 19
    resumed = launch("stopped")
    start = resumed["resumed_from"]["step"]
    assert start == 25, resumed  # in the middle of the second epoch
    assert resumed["status"] == "succeeded" and resumed["steps_completed"] == 4 * 19
    assert resumed["metrics"]["accuracy"] >= 0.9  # it learned
    # The workers loaded the copy Ray shipped with the job, not the file on this machine.
    loaded = {open(markers / name).read() for name in os.listdir(markers)}
    assert any(p != path and p.endswith("my_workload.py") and "runtime_resources" in p for p in loaded), loaded
