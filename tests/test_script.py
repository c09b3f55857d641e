"""Script mode: checks before any worker starts, exit statuses, and a real horovodrun-style script."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launcher.cli.main import main
from launcher.errors import UserError
from launcher.driver.program import from_script
from launcher.driver.script import Outcome

needs_horovod = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None,
    reason="Horovod is not built in this environment: run scripts/install-horovod (scripts/setup-env does)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_check_script_accepts_py_files_and_python_shebangs(tmp_path):
    py = tmp_path / "train.py"
    py.write_text("print(1)\n")
    program = from_script(str(py))
    assert (program.kind, program.folder, program.target) == ("script", str(tmp_path), "train.py")
    assert program.command()[1:] == [str(py)]
    tool = tmp_path / "train"
    tool.write_text("#!/usr/bin/env python3\nprint(1)\n")
    assert from_script(str(tool)).target == "train"


@pytest.mark.parametrize("name, content, message", [
    ("missing.py", None, "no such file"),
    ("folder.py", "DIR", "not a file"),
    ("train.sh", "#!/bin/bash\necho hi\n", "not a Python script"),
    ("broken.py", "import os\ndef f(:\n    pass\n", "broken.py line 2: syntax error"),
    ("imports.py", "import os\nimport no_such_module_anywhere\n", "line 2 imports no_such_module_anywhere"),
])
def test_check_script_rejects_what_cannot_run(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message):
        from_script(str(path))


def test_missing_script_is_rejected_before_any_worker(tmp_path, capsys):
    code = main(["run", "--script", str(tmp_path / "nope.py"), "--backend", "horovod", "--workers", "2",
                 "--storage", str(tmp_path / "runs"), "--", "--lr", "0.1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no such file" in err[0]
    assert not (tmp_path / "runs").exists()


def test_a_script_that_imports_torchvision_is_told_the_release_for_the_installed_torch(tmp_path, capsys):
    """torchvision is released in step with torch (each pins its torch): the advice names the one for
    the torch installed here, not a bare name whose newest release would bring another torch."""
    from importlib import metadata

    script = tmp_path / "vision.py"
    script.write_text("import torch\nimport torchvision\n")
    code = main(["run", "--script", str(script), "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    torch = metadata.version("torch")
    minor, patch = torch.split(".")[1], torch.split(".")[2].split("+")[0]
    assert code == 2 and len(err) == 1 and "line 2 imports torchvision" in err[0], err
    assert f"add torchvision==0.{int(minor) + 15}.{patch} (the release for the torch {torch} installed here) to " \
        f"{tmp_path / 'requirements.txt'}" in err[0], err


@pytest.mark.parametrize("torch,torchvision", [("2.0.1", "0.15.2"), ("2.1.0", "0.16.0"), ("2.9.1", "0.24.1"), ("2.5.1", "0.20.1"),
                                               ("2.13.0+cpu", "0.28.0"), ("1.13.1", None)])
def test_the_torchvision_release_follows_torchs(monkeypatch, torch, torchvision):
    """PyTorch's published pairs (2.0.1/0.15.2, 2.5.1/0.20.1; the 2.13.0+cpu and 0.28.0+cpu wheels this
    stack installs); a torch 1.x is left unsaid."""
    from importlib import metadata

    from launcher.driver.dependencies import release_for_torch

    monkeypatch.setattr(metadata, "version", lambda name: torch)
    said = release_for_torch("torchvision")
    assert (said.split(" ")[0] if said else None) == (f"torchvision=={torchvision}" if torchvision else None)
    assert release_for_torch("numpy") is None


@pytest.mark.integration
def test_a_signal_stops_a_script_run_with_exit_130(warm_head, tmp_path, signum=signal.SIGINT):
    # SIGINT here, on the session's warm head. SIGTERM (the CLI turns it into Ctrl-C) and a launch
    # that started a Ray of its own, which it then stops: tests/faults/test_signal_moments.py, at
    # each moment of a launch.
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "launcher", "run", "--script", str(script), "--workers", "2",
           "--storage", str(tmp_path / "runs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # a rank's script is running (its lines are progress: stderr)
        seen.append(line)
        if line.startswith("[rank 1] started") or line.startswith("[rank 0] started"):
            break
    started = time.time()
    proc.send_signal(signum)
    out, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert "[rank" not in out  # stdout holds the summary alone
    assert proc.returncode == 130, err
    assert "interrupted; the program was stopped on every worker" in err and time.time() - started < 60
    assert "SIGTERM received" not in err


def test_script_args_without_a_script_are_an_error(capsys):
    assert main(["run", "stray"]) == 2
    assert "program arguments go after --script" in capsys.readouterr().err


def test_outcome_exits_with_the_status_of_the_rank_that_failed_first():
    out = io.StringIO()
    o = Outcome(out)
    o.handle({"rank": 1, "attempt": "a1", "lines": ["a", "b"]})
    o.handle({"rank": 0, "attempt": "a1", "exit": 0, "time": 5.0})
    assert out.getvalue() == "[rank 1] a\n[rank 1] b\n"
    assert o.exit_code(2, None)[0] == 1  # rank 1 never reported: not a success
    o.handle({"rank": 1, "attempt": "a1", "exit": 0, "time": 5.0})
    assert o.exit_code(2, None) == (0, None)
    # rank 0 reports first, but rank 1 died first: rank 1's status is the script's
    o.handle({"rank": 0, "attempt": "a1", "exit": 1, "time": 7.5})
    o.handle({"rank": 1, "attempt": "a1", "exit": 4, "time": 7.0})
    assert o.exit_code(2, "rank 0: ScriptFailed") == (4, "rank 1 exited with status 4 (then also: rank 0)")
    o.handle({"rank": 1, "attempt": "a1", "exit": -9, "time": 7.0})
    assert o.exit_code(2, None)[0] == 137  # killed by SIGKILL, as a shell reports it
    # a restarted group that succeeded: the earlier group's failures no longer count
    o.handle({"rank": 0, "attempt": "a2", "exit": 0, "time": 9.0})
    o.handle({"rank": 1, "attempt": "a2", "exit": 0, "time": 9.0})
    assert o.exit_code(2, None) == (0, None) and o.last_statuses() == {0: 0, 1: 0}


SCRIPT = textwrap.dedent("""
    import sys
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"hello from {hvd.rank()} of {hvd.size()} local {hvd.local_rank()} sum {total:g} args {sys.argv[1:]}")
    print("second line", flush=True)
    fail_rank = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else -1
    if hvd.rank() == fail_rank:
        print("failing on purpose", file=sys.stderr)
        sys.exit(3)
""")


@needs_horovod
@pytest.mark.integration
def test_horovodrun_style_script_runs_on_every_rank_and_a_failure_propagates(ray_local, tmp_path, capsys):
    script = tmp_path / "hvd_train.py"
    script.write_text(SCRIPT)
    code = main(["run", "--script", str(script), "--backend", "horovod", "--workers", "2", "--job-dir-arg",
                 "--storage", str(tmp_path / "runs"), "--name", "hvd", "--", "--lr", "0.5", "x y", "--fail-rank", "1"])
    out, err = capsys.readouterr()
    args = f"['--lr', '0.5', 'x y', '--fail-rank', '1', '--job-dir', '{tmp_path / 'runs'}/hvd']"
    for r in range(2):
        assert f"[rank {r}] hello from {r} of 2 local {r} sum 3 args {args}" in err, out + err
        assert f"[rank {r}] second line" in err
    assert "[rank 1] failing on purpose" in err and "[rank" not in out  # progress, not the summary
    assert code == 3, out + err  # rank 1's exit status
    assert "error: rank 1 exited with status 3" in err
    # the ranks' output is kept in the run's storage too: `launcher logs NAME`, one rank's alone
    assert main(["logs", "hvd", "--storage", str(tmp_path / "runs"), "--rank", "1"]) == 0
    shown = capsys.readouterr().out
    assert "[rank 1] failing on purpose" in shown and "[rank 1] second line" in shown and "[rank 0]" not in shown


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://, as under torchrun
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {t.item():g}")
    dist.destroy_process_group()
""")


TF_CONFIG_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tensorflow as tf

    task = json.loads(os.environ["TF_CONFIG"])["task"]  # Vertex AI's form: a chief, then workers
    rank = 0 if task["type"] == "chief" else task["index"] + 1
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(float(rank + 1))), axis=None)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((4,)), tf.keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.ones((16, 4), np.float32), np.zeros(16, np.int64)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    print(f"worker {rank} sum {total.numpy():g} fit {len(history.history['loss'])} epochs args {sys.argv[1:]}")
    if str(rank) in sys.argv[1:2]:
        sys.exit(5)
""")


@pytest.mark.integration
def test_tf_config_script_runs_under_the_native_backend_and_a_failure_propagates(ray_local, tmp_path, capsys):
    script = tmp_path / "tf_train.py"
    script.write_text(TF_CONFIG_SCRIPT)
    code = main(["run", "--script", str(script), "--framework", "tensorflow", "--workers", "2", "--name", "tfjob",
                 "--storage", str(tmp_path / "runs"), "--", "1"])
    out, err = capsys.readouterr()
    for r in range(2):  # no --job-dir: a script gets it only with --job-dir-arg
        assert f"[rank {r}] worker {r} sum 3 fit 2 epochs args ['1']" in err, out + err
    assert code == 5, out + err
    assert "error: rank 1 exited with status 5" in err


@pytest.mark.integration
def test_torchrun_style_script_runs_under_the_native_backend_and_a_failure_propagates(ray_local, tmp_path, capsys):
    """One launch for both (as for the Horovod and TF_CONFIG scripts): every rank gets torchrun's
    env:// variables and all-reduces with the others, then rank 0 exits 7 and rank 1 exits 0.
    A script whose ranks all exit 0 is a succeeded run with exit 0: the package runs of
    test_programs.py (the same driver) and Outcome's rules above."""
    script = tmp_path / "ddp_fail.py"
    script.write_text(TORCHRUN_SCRIPT + "import sys\nsys.exit(7 if int(os.environ['RANK']) == 0 else 0)\n")
    code = main(["run", "--script", str(script), "--workers", "2", "--storage", str(tmp_path / "runs"),
                 "--name", "fails", "--json"])
    out, err = capsys.readouterr()
    for r in range(2):  # each rank ran the whole script before its exit
        assert f"[rank {r}] rank {r} of 2 local {r} sum 3" in err, out + err
    assert code == 7, out + err  # --max-failures 0 (the default): no restart, the rank's status
    assert "error: rank 0 exited with status 7" in err
    summary = json.loads(out)
    assert (summary["status"], summary["restarts"], summary["exit_codes"]["0"]) == ("failed", 0, 7), summary
    assert json.load(open(tmp_path / "runs" / "fails" / "summary.json"))["status"] == "failed"
