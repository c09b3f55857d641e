"""The user's own workloads (``--workload FILE.py:NAME``): checks before any worker, and training.

Every workload here is written to a temporary folder outside the repository,
so nothing is importable by accident; the examples in examples/ are trained
as a user would run them.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest

from launcher.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A complete workload; the bad ones below change one thing in it.
GOOD = '''
import numpy as np
import workloads
from workloads import Defaults, Param, Workload


def blobs(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[0, 3], [3, 0], [-3, -3]], dtype=np.float32)
    return centers[y] + rng.normal(0, 1, (n, 2)).astype(np.float32), y


class Blobs(Workload):
    def __init__(self):
        super().__init__(name="blobs", description="three Gaussian blobs", frameworks=FRAMEWORKS,
                         defaults=Defaults(epochs=2, batch_size=16, lr=0.01),
                         params=(Param("hidden", int, 16, "hidden units"),))

    def load(self, data, split, rank, world_size, params):
        x, y = blobs(600 if split == "train" else 200, 0 if split == "train" else 1)
        return workloads.shard(X_OF(x), y, split, rank, world_size)

    def input_shape(self, params):
        return SHAPE

    def num_classes(self, params):
        return 3

    def torch_model(self, params):
        import torch.nn as nn
        return nn.Sequential(nn.Linear(2, params["hidden"]), nn.ReLU(), nn.Linear(params["hidden"], 3))


FRAMEWORKS = ("torch",)
SHAPE = (2,)
X_OF = lambda x: x
BLOBS = Blobs()
'''


def write(folder, text: str, name: str = "my_workload.py") -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(str(folder), name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def elsewhere(tmp_path, monkeypatch):
    """The user's code in one folder, the current directory another (nothing importable by accident)."""
    code = tmp_path / "code"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return code


@pytest.mark.parametrize("change,reference,needles", [
    (None, "{code}/nope.py:BLOBS", ["no such file", "nope.py"]),
    (("BLOBS = Blobs()", "BLOBS = Blobs("), "{path}:BLOBS", ["syntax error in", "my_workload.py, line"]),
    (("import numpy as np\n", "import numpy as np\nimport not_a_module_anywhere\n"), "{path}:BLOBS",
     ["importing", "No module named 'not_a_module_anywhere'"]),
    (None, "{path}:NOPE", ["has no 'NOPE'", "it defines: BLOBS, Blobs"]),
    (("BLOBS = Blobs()", "BLOBS = 42"), "{path}:BLOBS", ["BLOBS is a int, not a workload"]),
    (("    def torch_model", "    def not_a_model"), "{path}:BLOBS",
     ["it says it supports torch but defines no torch_model(self, params)"]),
    (("X_OF = lambda x: x", "X_OF = lambda x: x[:-1]"), "{path}:BLOBS", ["599 inputs but 600 labels"]),
    (("SHAPE = (2,)", "SHAPE = (3,)"), "{path}:BLOBS", ["train inputs have shape (2,)", "input_shape() says (3,)"]),
    (None, "{path}:", ["is not FILE.py:NAME or package.module:NAME"]),
    (None, "{path}", ["my_workload.py is a file: name the workload in it", "my_workload.py:NAME"]),
    (None, "no_such_package.models:BLOBS", ["no module named 'no_such_package'"]),
])
def test_bad_workloads_are_one_line_before_any_worker(capsys, elsewhere, tmp_path, change, reference, needles):
    text = GOOD if change is None else GOOD.replace(*change)
    path = write(elsewhere, text)
    storage = tmp_path / "runs"
    code, out, err = run_cli(capsys, "run", "--workload", reference.format(path=path, code=elsewhere),
                             "--storage", str(storage), "--name", "bad")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (storage / "bad").exists()  # nothing of the run was started


def test_a_framework_the_workload_lacks_is_one_line(capsys, elsewhere, tmp_path):
    path = write(elsewhere, GOOD)
    code, _, err = run_cli(capsys, "run", "--workload", f"{path}:BLOBS", "--framework", "tensorflow",
                           "--storage", str(tmp_path / "runs"))
    assert code == 2 and "workload blobs has no tensorflow model; use --framework torch" in err


def test_workloads_describes_a_user_workload(capsys, elsewhere):
    path = write(elsewhere, GOOD)
    code, out, _ = run_cli(capsys, "workloads", os.path.relpath(path) + ":BLOBS", "--json")
    assert code == 0
    [described] = json.loads(out)
    assert described["name"] == "blobs" and described["frameworks"] == ["torch"]
    assert described["params"] == {"hidden": {"default": 16, "help": "hidden units"}}
    assert described["reference"] == f"{path}:BLOBS"  # made absolute: workers start elsewhere


def test_a_module_reference_imports_from_the_current_folder(capsys, tmp_path, monkeypatch):
    write(tmp_path / "proj" / "mypkg", "", "__init__.py")
    write(tmp_path / "proj" / "mypkg", GOOD, "models.py")
    monkeypatch.chdir(tmp_path / "proj")
    code, out, err = run_cli(capsys, "workloads", "mypkg.models:BLOBS")
    assert code == 0, err
    assert "blobs" in out and "--workload mypkg.models:BLOBS" in out


def test_a_dataset_source_is_read_item_by_item_in_the_order_given():
    import workloads

    class Squares:  # a map-style dataset, as a torch Dataset is
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full((2,), i, np.float32), i % 3

    train = workloads.shard(Squares(), None, "train", 1, 3)  # rank 1 of 3: items 1, 4, 7
    assert len(train) == 3
    x, y = train.take(np.array([2, 0]))
    assert x.tolist() == [[7, 7], [1, 1]] and y.tolist() == [1, 1] and x.dtype == np.float32
    test = workloads.shard(Squares(), None, "test", 0, 3)  # test shards cover everything: 0, 3, 6, 9
    assert len(test) == 4


def test_code_folder_size_is_checked_before_shipping(tmp_path):
    from launcher.driver import code
    from launcher.errors import UserError

    folder = tmp_path / "code"
    write(folder, GOOD)
    (folder / "weights.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (folder / ".git").mkdir()
    (folder / ".git" / "pack").write_bytes(os.urandom(4 * 1024 * 1024))  # excluded: never counted
    assert 3 * 1024 * 1024 < code.check_size(str(folder), limit_mb=10) < 4 * 1024 * 1024
    with pytest.raises(UserError, match=r"holds over 2 MiB to ship .*weights.bin \(3 MiB\).*\.rayignore"):
        code.check_size(str(folder), limit_mb=2)
    (folder / ".rayignore").write_text("weights.bin\n")  # as Ray honours it, so does the check
    assert code.check_size(str(folder), limit_mb=2) < 1024 * 1024


@pytest.mark.integration
@pytest.mark.parametrize("example,framework", [("shapes_torch.py", "torch"), ("shapes_keras.py", "tensorflow")])
def test_the_examples_learn(ray_local, capsys, tmp_path, monkeypatch, example, framework):
    monkeypatch.chdir(tmp_path)  # as a user would, from their own folder
    data = tmp_path / "data"
    code, out, err = run_cli(capsys, "run", "--workload", os.path.join(ROOT, "examples", example) + ":SHAPES",
                             "--framework", framework, "--workers", "2", "--epochs", "2",
                             "--data", _shapes_data(data), "--storage", str(tmp_path / "runs"), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["status"] == "succeeded" and s["epochs_completed"] == 2 and s["workers"] == 2
    assert s["metrics"]["accuracy"] >= 0.9 and s["model"]


def _shapes_data(folder) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("shapes_data", os.path.join(ROOT, "examples", "shapes_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(str(folder))
    return str(folder)


# A workload for the multi-node tests (tests/test_programs.py's run across two nodes, tests/chaos/):
# it notes which copy of itself each process loaded (in the --data folder), and --param delay_ms
# slows each forward pass, so a test can stop it in the middle of an epoch.
SHIPPED = GOOD + '''

class Noted(Blobs):
    def __init__(self):
        super().__init__()
        self.params = self.params + (Param("delay_ms", int, 0, "sleep in every forward pass"),
                                     Param("hold_after", int, 0, "after this many training steps, wait to be stopped"))

    def load(self, data, split, rank, world_size, params):
        import os
        if data:
            with open(os.path.join(data, f"loaded-{os.getpid()}"), "w") as f:
                f.write(os.path.abspath(__file__))
        return super().load(data, split, rank, world_size, params)

    def torch_model(self, params):
        import time
        import torch.nn as nn

        class Slow(nn.Module):
            calls = 0

            def forward(self, x):
                time.sleep(params["delay_ms"] / 1000)
                if self.training:
                    self.calls += 1
                    while params["hold_after"] and self.calls > params["hold_after"]:
                        time.sleep(0.5)  # the stop lands here, at a step the test chose
                return x

        return nn.Sequential(Slow(), super().torch_model(params))


NOTED = Noted()
'''


def test_bench_scaling_keeps_a_user_workloads_own_params(elsewhere):
    from benchmarks.scaling import Settings

    path = write(elsewhere, GOOD)
    config = Settings(workload=f"{path}:BLOBS", params={"hidden": 8}).worker_config()
    assert config["params"] == {"hidden": 8}  # no image_size / num_classes of the synthetic ones
    assert "image_size" in Settings().worker_config()["params"]


def test_a_memmap_stays_on_disk_and_reads_the_rows_asked_for(tmp_path):
    import workloads

    x = np.lib.format.open_memmap(str(tmp_path / "x.npy"), mode="w+", dtype=np.float32, shape=(10, 2))
    x[:] = np.arange(20, dtype=np.float32).reshape(10, 2)
    x.flush()
    on_disk = np.load(str(tmp_path / "x.npy"), mmap_mode="r")
    train = workloads.shard(on_disk, np.arange(10) % 3, "train", 0, 2)  # rank 0 of 2: rows 0, 2, 4, 6, 8
    assert type(train).__name__ == "ArraySplit" and len(train) == 5
    rows, labels = train.take(np.array([4, 1]))
    assert rows.tolist() == [[16, 17], [4, 5]] and labels.tolist() == [2, 2]


FRAMEWORK_IN_FUNCTIONS = '''
import heavyfw
import workloads


@workloads.training_function(epochs=1)
def train(session):
    return heavyfw.answer()
'''

FRAMEWORK_AT_TOP = '''
import heavyfw
import workloads

BASE = heavyfw.Base  # used while the file is imported


@workloads.training_function(epochs=1)
def train(session):
    return BASE
'''


def test_a_driver_loads_a_framework_the_users_file_imports_only_when_the_file_uses_it(tmp_path, monkeypatch):
    """defer_framework_imports (the driver's `launcher run`): a framework a file imports is loaded at
    its first use, not at the import line; one used at the file's top is loaded there, as before.
    A stand-in framework (a package that counts its loads) in place of TensorFlow and torch."""
    from workloads import user

    (tmp_path / "fw" / "heavyfw").mkdir(parents=True)
    (tmp_path / "fw" / "heavyfw" / "__init__.py").write_text(
        "import os\nLOADS = int(os.environ.get('HEAVYFW_LOADS', '0')) + 1\nos.environ['HEAVYFW_LOADS'] = str(LOADS)\n"
        "class Base: pass\ndef answer(): return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fw"))
    monkeypatch.setattr(user, "DEFERRABLE", user.DEFERRABLE + ("heavyfw",))
    monkeypatch.delenv("HEAVYFW_LOADS", raising=False)
    monkeypatch.delitem(sys.modules, "heavyfw", raising=False)

    with user.defer_framework_imports():
        lazy = user.load_reference(write(tmp_path / "a", FRAMEWORK_IN_FUNCTIONS, "lazy_fw.py") + ":train")
    assert "HEAVYFW_LOADS" not in os.environ and user.not_loaded_yet("heavyfw")
    assert lazy.fn(None) == 42 and os.environ["HEAVYFW_LOADS"] == "1"  # loaded once, at its first use
    assert not user.not_loaded_yet("heavyfw")

    monkeypatch.delenv("HEAVYFW_LOADS")
    monkeypatch.delitem(sys.modules, "heavyfw")
    with user.defer_framework_imports():
        eager = user.load_reference(write(tmp_path / "b", FRAMEWORK_AT_TOP, "eager_fw.py") + ":train")
    assert os.environ["HEAVYFW_LOADS"] == "1" and not user.not_loaded_yet("heavyfw")
    assert eager.fn(None).__name__ == "Base"
    monkeypatch.delitem(sys.modules, "heavyfw")
    # Outside the context (a worker), the import line loads it.
    monkeypatch.delenv("HEAVYFW_LOADS")
    user.load_reference(write(tmp_path / "c", FRAMEWORK_IN_FUNCTIONS, "plain_fw.py") + ":train")
    assert os.environ["HEAVYFW_LOADS"] == "1" and not user.not_loaded_yet("heavyfw")
    monkeypatch.delitem(sys.modules, "heavyfw")
    # A deferrable framework that is not installed still fails the import, in one line.
    monkeypatch.setattr(user, "DEFERRABLE", user.DEFERRABLE + ("absentfw",))
    with user.defer_framework_imports(), pytest.raises(user.WorkloadError) as failed:
        user.load_reference(write(tmp_path / "d", FRAMEWORK_IN_FUNCTIONS.replace("heavyfw", "absentfw"),
                                  "absent_fw.py") + ":train")
    assert "No module named 'absentfw'" in str(failed.value) and "\n" not in str(failed.value)
