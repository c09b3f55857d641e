"""`launcher predict` (Ray Data) and `launcher serve` (Ray Serve) on models real runs exported.

A torch and a TensorFlow digits model are trained once (1 epoch each) on the
session's local Ray. Batch predictions over the test split (written raw, as
.npy and as JSON lines) must give exactly the accuracy the run reported. The
server is a real `launcher serve` process answering a real HTTP client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import workloads
from launcher.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(ray_local, tmp_path_factory):
    """framework -> (model folder, the run's reported accuracy), from real 1-epoch runs."""
    from launcher import JobSpec, run

    storage = str(tmp_path_factory.mktemp("predict") / "runs")
    out = {}
    for framework in ("torch", "tensorflow"):
        spec = JobSpec(workload="digits-mlp", framework=framework, epochs=1, workers=1, storage=storage,
                       name=f"digits_{framework}").validated()
        summary = run(spec, show_progress=False)
        assert summary.status == "succeeded", summary.error
        out[framework] = (os.path.join(storage, spec.name), summary.metrics["accuracy"])
    return out


@pytest.fixture(scope="module")
def test_split(tmp_path_factory):
    """The digits test split as a user has it: raw pixel values 0..16, as .npy and JSON lines."""
    split = workloads.get("digits-mlp").load(None, "test", 0, 1, {})
    raw = split.x * 16.0  # the workload's preprocessing divides by 16 (exactly)
    d = tmp_path_factory.mktemp("instances")
    np.save(d / "test.npy", raw)
    with open(d / "test.jsonl", "w") as f:
        for lo in range(0, len(raw), 100):
            f.write(json.dumps({"instances": raw[lo:lo + 100].tolist()}) + "\n")
    return d, raw, split.y



def last_line(out: str) -> str:
    """The --json summary: stdout's last line (in-process, Ray may print a warning to stdout
    first; the CLI itself sends everything but the summary to stderr)."""
    return out.strip().splitlines()[-1]

def read_predictions(folder: str) -> dict[str, list[int]]:
    """file -> predictions in row order, from the JSON-lines output."""
    rows = [json.loads(line) for name in sorted(os.listdir(folder)) for line in open(os.path.join(folder, name))]
    out: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: (r["file"], r["row"])):
        out.setdefault(r["file"], []).append(r["prediction"])
        assert len(r["scores"]) == 10 and abs(sum(r["scores"]) - 1) < 1e-4
    return out


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_batch_predictions_reproduce_the_runs_accuracy(models, test_split, tmp_path, capsys, framework):
    run_dir, accuracy = models[framework]
    folder, raw, labels = test_split
    out = str(tmp_path / "preds")
    code = main(["predict", "--model", run_dir, "--input", str(folder), "--output", out, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(last_line(captured.out))
    assert summary["rows"] == 2 * len(labels) and summary["files"] == 2 and summary["rows_per_s"] > 0
    predicted = read_predictions(out)
    for name in ("test.npy", "test.jsonl"):
        assert np.mean(np.asarray(predicted[name]) == labels) == pytest.approx(accuracy, abs=1e-6)
    # the output is never overwritten
    assert main(["predict", "--model", run_dir, "--input", str(folder), "--output", out]) == 2
    assert "already holds files" in capsys.readouterr().err


def test_bad_prediction_input_is_one_line_before_any_worker(models, test_split, tmp_path, capsys):
    run_dir, _ = models["torch"]
    np.save(tmp_path / "wrong.npy", np.zeros((4, 10)))
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        (["--model", str(tmp_path / "nope")], "nothing at"),
        (["--run", "digits_torch", "--storage", str(tmp_path)], "nothing at"),
        (["--model", run_dir, "--input", str(tmp_path / "wrong.npy")], "each instance must have shape [64]"),
        (["--model", run_dir, "--input", str(tmp_path / "*.txt")], "notes.txt is not a"),
        (["--model", run_dir, "--input", str(tmp_path / "missing")], "nothing at"),
    ]
    for flags, message in cases:
        argv = ["predict", "--output", str(tmp_path / "out")] + flags
        if "--input" not in flags:
            argv += ["--input", str(test_split[0])]
        assert main(argv) == 2, flags
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (flags, err)


@pytest.mark.integration
@pytest.mark.gcs
def test_predict_reads_and_writes_cloud_storage(models, test_split, bucket, capsys):
    from launcher.storage import Storage

    run_dir, accuracy = models["torch"]
    folder, _, labels = test_split
    inputs = Storage.resolve(f"gs://{bucket}/in")
    inputs.upload_dir(str(folder))
    code = main(["predict", "--model", run_dir, "--input", f"gs://{bucket}/in/*.npy", "--output",
                 f"gs://{bucket}/out"])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert "predicted 359 rows from 1 file(s)" in capsys.readouterr().out
    out = Storage.resolve(f"gs://{bucket}/out")
    rows = sorted((json.loads(line) for name in out.list_files() for line in out.read_text(name).splitlines()),
                  key=lambda r: r["row"])
    assert np.mean(np.asarray([r["prediction"] for r in rows]) == labels) == pytest.approx(accuracy, abs=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_serve_answers_like_batch_prediction_and_refuses_bad_requests(models, test_split, tmp_path, framework):
    run_dir, accuracy = models[framework]
    _, raw, labels = test_split
    port = free_port()
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.err", "w+")  # a pipe nobody reads would fill up and block the server
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--model", run_dir, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + (tmp_path / "serve.err").read_text()[-3000:]
        url = f"http://127.0.0.1:{port}"
        health = json.load(urllib.request.urlopen(url + "/healthz", timeout=30))
        assert health["status"] == "ok" and health["framework"] == framework
        code, body = post(url + "/", {"instances": raw.tolist()})
        assert code == 200
        predicted = np.asarray([p["prediction"] for p in body["predictions"]])
        assert np.mean(predicted == labels) == pytest.approx(accuracy, abs=1e-6)
        for bad, message in [(b"{not json", "not JSON"), ({"instances": []}, "instances is empty"),
                             ({"instances": [[1, 2, 3]]}, "each instance must have shape [64]"),
                             ({"instances": [["a"] * 64]}, "must be numbers, got text"),
                             ({"rows": [[0] * 64]}, "instances list"),
                             ({"instances": [[0] * 64] * 2000}, "at most 1024")]:
            code, answer = post(url + "/predict", bad)
            assert code == 400 and message in answer["error"], (bad if isinstance(bad, bytes) else "", answer)
        # 200 requests from 8 threads, batched by Ray Serve: each answers for its own instance
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: post(url, {"instances": raw[i:i + 1].tolist()}), range(200)))
        assert all(c == 200 for c, _ in answers)
        assert [a["predictions"][0]["prediction"] for _, a in answers] == predicted[:200].tolist()
    finally:
        stopped = subprocess.run([sys.executable, "-m", "launcher", "serve", "--stop"], capture_output=True,
                                 text=True, env=env, cwd=ROOT, timeout=120)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    log.close()
    assert stopped.returncode == 0 and "stopped the model server" in stopped.stdout, \
        stopped.stderr + (tmp_path / "serve.err").read_text()[-3000:]
    assert proc.returncode == 0


def test_image_files_are_instances_the_image_workloads_take(tmp_path):
    """A folder of PNGs: each file is one instance, preprocessed as the workload trains on it."""
    from PIL import Image

    from launcher.predict.batch import parse

    grey = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28)
    colour = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for name, pixels in (("grey.png", grey), ("colour.png", colour)):
        Image.fromarray(pixels).save(tmp_path / name)
    read = {name: parse(name, (tmp_path / name).read_bytes()) for name in ("grey.png", "colour.png")}
    assert np.array_equal(read["grey.png"][0], grey) and np.array_equal(read["colour.png"][0], colour)
    mnist = workloads.get("mnist-cnn").preprocess(read["grey.png"], {})
    cifar = workloads.get("cifar10-cnn").preprocess(read["colour.png"], {})
    assert mnist.shape == (1, 1, 28, 28) and cifar.shape == (1, 3, 32, 32)
    # the same numbers the training loaders compute from the raw files
    from workloads import cifar as cifar_module, mnist as mnist_module

    assert np.allclose(mnist[0, 0], (grey / 255.0 - mnist_module.MEAN) / mnist_module.STD, atol=1e-6)
    expected = (colour.transpose(2, 0, 1) / 255.0 - cifar_module.MEAN) / cifar_module.STD
    assert np.allclose(cifar[0], expected, atol=1e-6)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="bad.png is not a readable image"):
        parse("bad.png", (tmp_path / "bad.png").read_bytes())
