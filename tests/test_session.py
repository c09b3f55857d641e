"""Training functions (``def train(session)``): the user's own loop with the launcher's guarantees.

The fast tests check how a function is recognised, described and refused; the
integration tests train examples/char_lm.py (a causal transformer language model
written as an ordinary PyTorch loop) with 2 workers and resume it from a mid-epoch
checkpoint: the resumed run must end with the uninterrupted run's weights, with DDP and
with Horovod. Broken functions (one that
never steps, one that registers no model, a dataset whose items cannot be batched)
end as failed runs whose error names the user's file and line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import workloads
from launcher.faultpoint import ENV, MARK_ENV
from test_user_workloads import elsewhere, run_cli, write  # noqa: F401 - elsewhere: a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_LM = os.path.join(ROOT, "examples", "char_lm.py") + ":train"
CHARS = 40_000  # of Python's own help topics: 18 steps per epoch with 2 workers, batch 16


def topics_file(folder) -> str:
    """A UTF-8 text file made from text that ships with Python."""
    import pydoc_data.topics

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(str(folder), "topics.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(pydoc_data.topics.topics.values())[:CHARS])
    return path


# -- recognising and describing a function (no Ray) -----------------------------------------------

FUNCTIONS = '''
import workloads

def train(session):
    """Fits nothing: a function the launcher can recognise."""

def ray_style(config):
    pass

def two(session, other):
    pass

@workloads.training_function(epochs=4, batch_size=8, lr=0.5,
                             params=[workloads.Param("width", int, 3, "how wide")])
def declared(session):
    pass
'''


def test_functions_are_told_apart_by_their_parameter(elsewhere):
    path = write(elsewhere, FUNCTIONS)
    session_fn = workloads.get(f"{path}:train")
    assert isinstance(session_fn, workloads.TrainingFunction) and session_fn.kind == "session"
    assert session_fn.description == "Fits nothing: a function the launcher can recognise."
    assert session_fn.frameworks == ("torch", "tensorflow")  # its module imports neither
    assert workloads.get(f"{path}:ray_style").kind == "ray-train"
    declared = workloads.get(f"{path}:declared")
    assert (declared.defaults.epochs, declared.defaults.batch_size, declared.defaults.lr) == (4, 8, 0.5)
    assert declared.resolve_params({"width": "5"}) == {"width": 5}
    with pytest.raises(KeyError, match="has no parameter 'depth'"):
        declared.resolve_params({"depth": "2"})
    # Without a declaration any --param goes, read as a number or a boolean where it is one.
    assert session_fn.resolve_params({"a": "3", "b": "0.5", "c": "true", "d": "text"}) == \
        {"a": 3, "b": 0.5, "c": True, "d": "text"}


def test_workloads_describes_a_training_function(capsys, elsewhere):
    path = write(elsewhere, FUNCTIONS)
    code, out, _ = run_cli(capsys, "workloads", f"{path}:declared", "--json")
    assert code == 0
    [d] = json.loads(out)
    assert d["kind"].startswith("training function") and d["defined_at"].startswith(path)
    assert d["defaults"]["epochs"] == 4 and d["params"]["width"]["default"] == 3
    code, out, _ = run_cli(capsys, "workloads", CHAR_LM)
    assert code == 0 and "character-level causal transformer" in out and "--param context=" in out


@pytest.mark.parametrize("reference,needle", [
    ("{path}:two", "two is a function, not a workload"),
    ("{path}:nope", "has no 'nope'; it defines: declared, ray_style, train"),
])
def test_a_function_that_cannot_train_is_one_line(capsys, elsewhere, tmp_path, reference, needle):
    path = write(elsewhere, FUNCTIONS)
    code, out, err = run_cli(capsys, "run", "--workload", reference.format(path=path),
                             "--storage", str(tmp_path / "runs"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_a_function_importing_only_names_from_a_framework_trains_with_it(elsewhere):
    # `from torch.utils.data import DataLoader` and no `import torch`: still a torch function
    path = write(elsewhere, "from torch.utils.data import DataLoader\n" + FUNCTIONS, name="torch_names.py")
    assert workloads.get(f"{path}:train").frameworks == ("torch",)
    path = write(elsewhere, "from tensorflow.keras.layers import Dense\n" + FUNCTIONS, name="tf_names.py")
    assert workloads.get(f"{path}:train").frameworks == ("tensorflow",)


def test_a_torch_function_is_refused_for_tensorflow(capsys, elsewhere, tmp_path):
    path = write(elsewhere, "import torch\n" + FUNCTIONS)
    code, _, err = run_cli(capsys, "run", "--workload", f"{path}:train", "--framework", "tensorflow",
                           "--storage", str(tmp_path / "runs"))
    assert code == 2 and "has no tensorflow model" in err


# -- training (a real local Ray, real processes) --------------------------------------------------

def launch(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", "run", "--json", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, expect: int = 0) -> dict:
    out, err = proc.communicate(timeout=420)
    assert proc.returncode == expect, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def epoch_records(storage: str, name: str, metrics: list[str]) -> dict[int, dict[str, float]]:
    """The run log's epoch lines of run ``name``: epoch -> the named metrics."""
    from launcher.storage.runlog import read_jsonl

    with open(os.path.join(storage, name, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [m for m in read_jsonl(f.read()) if m.get("kind") == "epoch"]
    return {m["epoch"]: {k: m[k] for k in metrics} for m in lines}


def assert_same_epochs(storage: str, whole: str, resumed: str, metrics: list[str]) -> None:
    """Every epoch of the resumed run, the interrupted one included, reports what the
    uninterrupted run reported for it."""
    expected, got = epoch_records(storage, whole, metrics), epoch_records(storage, resumed, metrics)
    assert sorted(got) == sorted(expected), (got, expected)
    for epoch, values in expected.items():
        assert got[epoch] == pytest.approx(values, rel=1e-6), (epoch, got[epoch], values)


def stop_after_step_checkpoint(args: list[str], marks, until=None) -> dict:
    """Launch, hold rank 0 right after its first step checkpoint (and then until ``until()``
    is true, if given), Ctrl-C, return the summary."""
    mark = os.path.join(str(marks), "step-checkpoint")
    proc = launch(args, env={ENV: "step-checkpoint:120", MARK_ENV: mark})
    deadline = time.time() + 300
    while not os.path.exists(mark) or (until is not None and not until()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    return finish(proc, expect=130)


def seed_run_from_step_checkpoint(storage: str, source: str, name: str, step: int) -> None:
    """Make run ``name`` a run that stopped after its step-``step`` checkpoint: that checkpoint
    of run ``source`` (an uninterrupted run with step checkpoints, which change no weight), alone
    in the new run's folder. (A launch stopped by a signal there costs a launch more; the signal
    paths of a training function's launch are test_data_stream.py's and test_sharded.py's.)"""
    import shutil

    from launcher.storage import Storage, complete_checkpoints

    (path,) = [p for m, p in complete_checkpoints(Storage.resolve(storage), source) if m.global_step == step]
    shutil.copytree(path, os.path.join(storage, name, os.path.basename(path)))


@pytest.mark.integration
def test_char_lm_resumed_mid_epoch_ends_with_the_same_weights(warm_head, tmp_path):
    # On Horovod where it is built (CI builds it): the native backend's mid-epoch resume is
    # bitwise-checked by test_session_chaos::test_a_notice_costs_a_training_function_no_steps.
    from launcher.backends import horovod

    backend = "native" if horovod.probe("torch") else "horovod"
    storage = str(tmp_path / "runs")
    args = ["--workload", CHAR_LM, "--data", topics_file(tmp_path / "data"), "--storage", storage,
            "--backend", backend, "--epochs", "2", "--checkpoint-every-steps", "4", "--keep-checkpoints", "20"]

    whole = finish(launch(args + ["--name", "whole"]))
    assert whole["status"] == "succeeded" and whole["steps_completed"] == 2 * 18, whole
    m = whole["metrics"]
    assert {"train_loss", "val_loss", "perplexity"} <= set(m), m
    vocab = len(set(open(os.path.join(tmp_path, "data", "topics.txt"), encoding="utf-8").read()))
    assert m["val_loss"] < 0.8 * math.log(vocab), m  # it learned: well below guessing among the characters

    seed_run_from_step_checkpoint(storage, "whole", "stopped", 4)
    resumed = finish(launch(args + ["--name", "stopped"]))
    assert resumed["resumed_from"] == {"epoch": 0, "step": 4}, resumed  # in the middle of the first epoch
    assert resumed["status"] == "succeeded" and resumed["steps_completed"] == 2 * 18
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    # The resumed epoch reports the whole epoch's mean, not only the steps after the resume.
    assert resumed["metrics"]["train_loss"] == pytest.approx(m["train_loss"], rel=1e-6)
    assert_same_epochs(storage, "whole", "stopped", ["train_loss", "val_loss", "perplexity"])

    # The exported model loads into the user's own class.
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("char_lm", CHAR_LM.rsplit(":", 1)[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state = torch.load(os.path.join(storage, "stopped", "model", "state_dict.pt"))
    net = module.CharTransformer(vocab, 64, 64, 2, 4)
    net.load_state_dict(state)
    # ... and its program (exported from the first batch the model saw) predicts as that class does
    from launcher.predict.model import Model, locate

    served = Model(locate(os.path.join(storage, "stopped")))
    assert served.about()["inputs"] == [{"name": "ids", "shape": [-1], "dtype": "int64"}]  # any length
    ids = torch.randint(0, vocab, (3, 64))
    with torch.no_grad():
        expected = net.eval()(ids).numpy()
    np.testing.assert_allclose(served.run(served.inputs(ids.tolist()))["output"], expected, rtol=1e-4, atol=1e-4)

    # `launcher predict` through char_lm's predict hook: prompts in, continuations out, as greedy
    # decoding with the user's own class gives
    chars = sorted(set(open(os.path.join(tmp_path, "data", "topics.txt"), encoding="utf-8").read()))
    prompts = ["The ", "def f"]
    continuations = []
    for prompt in prompts:
        seq = [chars.index(c) for c in prompt]
        for _ in range(12):
            with torch.no_grad():
                seq.append(int(net(torch.tensor([seq[-64:]]))[0, -1].argmax()))
        continuations.append("".join(chars[t] for t in seq[len(prompt):]))
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"instances": [p]}) for p in prompts))
    done = subprocess.run([sys.executable, "-m", "launcher", "predict", "--model", os.path.join(storage, "stopped"),
                           "--input", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "preds")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for name in sorted(os.listdir(tmp_path / "preds")) if not name.startswith("_")
            for line in open(tmp_path / "preds" / name)]
    by_row = [r["prediction"] for r in sorted(rows, key=lambda r: r["row"])]
    assert len(by_row) == 2 and all(len(b) == 40 for b in by_row), by_row
    assert [served.predict([p], {"chars": 12})[0] for p in prompts] == continuations
    assert [b[:12] for b in by_row] == continuations  # the command's default: 40 characters


BROKEN = '''
import torch
import workloads


class Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.zeros(1 + i % 3), torch.tensor(0.0)


@workloads.training_function(epochs=1, batch_size=4)
def no_steps(session):  # no_steps fails here
    model = torch.nn.Linear(1, 1)
    session.register(model=model)
    for _ in range(3):
        pass


@workloads.training_function(epochs=1, batch_size=4)
def no_model(session):
    for epoch in session.epochs():  # no_model fails here
        session.step(loss=0.0)


@workloads.training_function(epochs=1, batch_size=4)
def ragged(session):
    model = session.prepare(torch.nn.Linear(1, 1))
    session.register(model=model)
    for epoch in session.epochs():
        for x, y in session.loader(Ragged()):  # ragged fails here
            session.step(loss=0.0)


@workloads.training_function(epochs=2, batch_size=4)
def loader_in_loop(session):
    model = session.prepare(torch.nn.Linear(1, 1))
    session.register(model=model)
    for epoch in session.epochs():
        for x, y in session.loader([(torch.zeros(1), torch.zeros(1))] * 8):  # loader_in_loop fails here
            session.step(loss=0.0)


@workloads.training_function(epochs=1, batch_size=4)
def raises(session):
    model = session.prepare(torch.nn.Linear(1, 1))
    session.register(model=model)
    for epoch in session.epochs():
        values = {}
        values["missing"]  # raises fails here
'''


# What each misuse says (checked in the fast tier, test_session_state, on the session without Ray)
BROKEN_CASES = [
    ("no_steps", ["no_steps(session) at", "returned without training", "session.epochs()"]),
    ("no_model", ["`session.epochs()` at", "before any model was registered", "session.register(model="]),
    ("ragged", ["the default collate cannot batch the items of Ragged", "collate_fn="]),
    ("raises", ["KeyError in raises(session) at", "missing"]),
    ("loader_in_loop", ["runs again in the next epoch", "make the training loader once, before `for epoch in "
                        "session.epochs():`"]),
]


def marked_line(code: str, name: str) -> int:
    """The line of ``code`` (as written to a file) marked ``# NAME fails here``."""
    lines = code.splitlines()
    return 1 + lines.index(next(t for t in lines if t.endswith(f"# {name} fails here")))


def broken_line(name: str) -> int:
    """The line of BROKEN where the function ``name`` fails."""
    return marked_line(BROKEN, name)


SEEN = '''
import json
import os
import time

import torch
import workloads


@workloads.training_function(epochs=2, batch_size=4)
def seen(session):
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.prepare(model, optimizer)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader([torch.tensor([float(i)]) for i in range(64)])
    out = os.path.join(session.params["log"], f"{os.getpid()}-{session.rank}.jsonl")
    for epoch in session.epochs():
        for x in loader:
            loss = model(x / 64).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with open(out, "a") as f:  # before session.step, where a held rank 0 stops
                f.write(json.dumps({"epoch": epoch, "step": session.global_step + 1, "world": session.world_size,
                                    "t": time.time(), "items": x.squeeze(-1).int().tolist()}) + "\\n")
            session.step(loss=loss)
'''


def resized_twice(args: list[str], marks, log) -> list[list[dict]]:
    """Run ``args`` on 2 workers, stop it after its first step checkpoint (step 3), resume it on 1
    worker and stop that after its first (step 6), resume on 2 to the end. The sample records
    the workload wrote (``log``: one JSON line per step and rank, with the time), those of the
    steps each checkpoint kept: steps after a stop's checkpoint are lost work, trained again."""
    phases, ends = [], []
    for folder in ("first", "second"):
        (marks / folder).mkdir()
    stopped = stop_after_step_checkpoint(args + ["--workers", "2"], marks / "first")
    assert stopped["status"] == "cancelled", stopped
    ends.append(time.time())
    shrunk = stop_after_step_checkpoint(args + ["--workers", "1"], marks / "second")
    assert shrunk["status"] == "cancelled" and shrunk["resumed_from"]["step"] == 3, shrunk
    ends.append(time.time())
    grown = finish(launch(args + ["--workers", "2"]))
    assert grown["status"] == "succeeded" and grown["resumed_from"]["step"] == 6, grown
    records = [json.loads(line) for f in sorted(log.iterdir()) for line in f.read_text().splitlines()]
    for phase, (after, until, kept_to) in enumerate([(0, ends[0], 3), (ends[0], ends[1], 6), (ends[1], 1e18, 10**9)]):
        phases.append([r for r in records if after <= r["t"] < until and r["step"] <= kept_to])
        assert {r["world"] for r in phases[-1]} == {2 if phase != 1 else 1}, phases[-1]
    return phases


def run_resized_twice(tmp_path, code: str, filename: str, *flags: str) -> list[list[dict]]:
    """:func:`resized_twice` of the function ``seen`` in ``code`` (which logs each step's sample
    ids into ``--param log``), with checkpoints every 3 steps; the run is named ``resized``."""
    path = write(tmp_path / "code", code, filename)
    log = tmp_path / "seen"
    log.mkdir()
    args = ["--workload", f"{path}:seen", "--storage", str(tmp_path / "runs"), "--param", f"log={log}",
            "--checkpoint-every-steps", "3", "--name", "resized", *flags]
    return resized_twice(args, tmp_path, log)


def assert_each_sample_once(phases: list[list[dict]], n: int, epochs: int) -> None:
    kept = [r for phase in phases for r in phase]
    for epoch in range(epochs):
        items = [i for r in kept if r["epoch"] == epoch for i in r["items"]]
        assert sorted(items) == list(range(n)), (epoch, sorted(items))  # nothing repeated, nothing skipped


UNREGISTERED = '''
import torch
import workloads


def _loop(session, register):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    model, optimizer = session.prepare(model, optimizer)
    register(model, optimizer, scheduler)
    loader = session.loader(list(zip(x, y)))
    for epoch in session.epochs():
        if epoch == 1:  # the second epoch
            values = {}
            values["missing"]  # model_only fails here
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            session.step(loss=loss)


@workloads.training_function(epochs=2, batch_size=8)
def model_only(session):
    _loop(session, lambda m, o, s: session.register(model=m))
'''


@pytest.mark.integration
def test_unregistered_state_is_named_once_and_a_later_exception_fails_the_run_naming_the_users_line(
        ray_local, capsys, elsewhere, tmp_path):
    """One launch, two things a run of a user's function says (each took a launch of its own).
    Before the first step, the state the session saw but no checkpoint holds, said once by the
    driver though every rank found it: which objects count (registered, stood in for, without
    state) is tests/test_session_state.py's; that a managed loop says nothing,
    test_train_local.py's. Then an exception in the function on the workers, in its second
    epoch (the note stopped nothing: the first epoch trained through), is the run's error, with
    the user's file and line; each misuse's own line is test_session_state's, on BROKEN."""
    path = write(elsewhere, UNREGISTERED, "partly.py")
    code, out, err = run_cli(capsys, "run", "--workload", f"{path}:model_only", "--storage",
                             str(tmp_path / "runs"), "--workers", "2", "--json")
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and summary["status"] == "failed", err
    where = f"{path}:{marked_line(UNREGISTERED, 'model_only')}"
    for needle in ("KeyError in model_only(session) at", "missing", where):
        assert needle in summary["error"], summary["error"]
    lines = [line for line in err.splitlines() if "a resumed run will not be exact" in line]
    assert len(lines) == 1, err
    for needle in ("the optimizer AdamW is not registered", "session.register(optimizer=...)",
                   "the LR scheduler StepLR is not registered", "session.register(scheduler=...)"):
        assert needle in lines[0], lines[0]


# A function written for Ray Train's TorchTrainer, in the style of Ray's documentation: it
# reports a checkpoint every epoch and resumes from ray.train.get_checkpoint().
RAY_FUNCTION = """
import os
import tempfile

import torch
import torch.nn as nn

import ray.train
import ray.train.torch


def train_loop_per_worker(config):
    '''Ray Train's documentation style: report a checkpoint each epoch, resume from get_checkpoint().'''
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    dataset = torch.utils.data.TensorDataset(x, y)
    model = ray.train.torch.prepare_model(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(dataset, batch_size=config["batch_size"], shuffle=True))
    for epoch in range(start, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb).squeeze(-1), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            if ray.train.get_context().get_world_rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           os.path.join(d, "state.pt"))
            ray.train.report({"loss": loss.item(), "epoch": epoch, "started_at_epoch": start},
                             checkpoint=ray.train.Checkpoint.from_directory(d))
        if config.get("stop_after") and epoch + 1 >= config["stop_after"] and start == 0:
            import time
            time.sleep(300)
"""


@pytest.mark.integration
def test_a_ray_train_function_runs_as_it_is_and_resumes_from_its_checkpoint(warm_head, elsewhere, tmp_path):
    """Its two launches (stopped with Ctrl-C after two epochs, resumed) are `launcher run`
    processes on the session's warm head, as the other resume tests here: each would otherwise
    start and stop a local Ray of its own. The function resumes from the checkpoint the launcher
    hands it (Ray Train's get_checkpoint): the epoch it starts at is read from that checkpoint's
    own file, saved with the weights. (That a relaunch ends with an uninterrupted run's weights
    is the function's own business here; for the launcher's sessions it is checked bitwise,
    test_char_lm_resumed_mid_epoch_ends_with_the_same_weights.)"""
    path = write(elsewhere, RAY_FUNCTION, "ray_style.py")
    storage = str(tmp_path / "runs")
    args = ["--workload", f"{path}:train_loop_per_worker", "--storage", storage, "--epochs", "4", "--lr", "0.05"]
    proc = launch(args + ["--name", "stopped", "--param", "stop_after=2"])
    deadline = time.time() + 300
    while len([d for d in os.listdir(os.path.join(storage, "stopped")) if d.startswith("checkpoint_")]
              if os.path.isdir(os.path.join(storage, "stopped")) else []) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # Ray Train registers the second checkpoint in its list
    proc.send_signal(signal.SIGINT)
    assert finish(proc, expect=130)["status"] == "cancelled"
    resumed = finish(launch(args + ["--name", "stopped", "--param", "stop_after=2"]))
    assert resumed["status"] == "succeeded" and resumed["epochs_completed"] == 4, resumed
    assert resumed["metrics"]["started_at_epoch"] == 2, resumed  # from the second epoch's checkpoint
    assert resumed["metrics"]["loss"] < 1.0, resumed  # it learned


def test_a_ray_train_function_runs_on_the_native_backend_only(capsys, elsewhere, tmp_path):
    path = write(elsewhere, FUNCTIONS)
    code, _, err = run_cli(capsys, "run", "--workload", f"{path}:ray_style", "--backend", "horovod",
                           "--storage", str(tmp_path / "runs"))
    assert code == 2 and "ray_style(config) is a Ray Train function" in err, err


@pytest.mark.integration
def test_a_training_function_is_tuned_on_a_metric_of_its_own(ray_local, capsys, tmp_path):
    import textwrap

    data = topics_file(tmp_path / "data")
    config = tmp_path / "tune.yaml"
    config.write_text(textwrap.dedent(f"""
        workload: {CHAR_LM}
        data: {data}
        epochs: 1
        workers: 1
        params: {{max_chars: 12000}}
        hyperparameters:
          goal: MINIMIZE
          hyperparameterMetricTag: val_loss
          maxTrials: 2
          maxParallelTrials: 1
          params:
            - parameterName: width
              type: DISCRETE
              discreteValues: [16, 48]
    """))
    code, out, err = run_cli(capsys, "tune", "--config", str(config), "--storage", str(tmp_path / "runs"),
                             "--name", "lm_search", "--json")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    rows, best = result["trials"], result["summary"]["best"]
    assert len(rows) == 2 and all(r["status"] == "succeeded" for r in rows), rows
    assert sorted(r["width"] for r in rows) == [16, 48]
    assert best["val_loss"] == min(r["val_loss"] for r in rows)
