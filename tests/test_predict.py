"""`launcher predict` (Ray Data) and `launcher serve` (Ray Serve) on models real runs exported.

A torch and a TensorFlow digits model are trained once (1 epoch each) on the
session's local Ray. Batch predictions over the test split (written raw, as
.npy and as JSON lines) must give exactly the accuracy the run reported. The
server is a real `launcher serve` process answering a real HTTP client.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import workloads
from launcher.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("command", ["predict", "serve"])
@pytest.mark.parametrize("described,needle", [
    ({"workload": "examples/char_lm.py:train", "framework": "torch", "kind": "training function",
      "params": {}, "files": {"state_dict.pt": "weights"}}, "a training function's model (state_dict.pt)"),
    ({"workload": "diabetes-mlp", "framework": "torch", "input_shape": [10], "num_classes": None,
      "params": {}, "files": {"model.pt2": "program"}}, "the model's workload diabetes-mlp cannot be loaded"),
])
def test_a_model_predict_cannot_take_is_one_line_before_ray_starts(tmp_path, capsys, command, described, needle):
    model = tmp_path / "runs" / "r1" / "model"
    model.mkdir(parents=True)
    (model / "model.json").write_text(json.dumps(described))
    argv = [command, "--run", "r1", "--storage", str(tmp_path / "runs")]
    if command == "predict":
        argv += ["--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.fixture()
def linear_model(tmp_path):
    """A scikit-learn model folder (model.joblib) of 3 inputs, loaded without Ray."""
    import joblib
    from sklearn.linear_model import LinearRegression

    folder = tmp_path / "linear"
    folder.mkdir()
    x = np.arange(30, dtype=np.float64).reshape(10, 3)
    joblib.dump(LinearRegression().fit(x, x.sum(axis=1)), folder / "model.joblib")
    return str(folder)


@pytest.mark.parametrize("output", ["afile.pt", "afile.pt/predictions"])
def test_an_output_that_is_a_file_is_one_line_before_ray_starts(tmp_path, capsys, linear_model, output):
    (tmp_path / "in.csv").write_text("a,b,c\n1,2,3\n")
    (tmp_path / "afile.pt").write_bytes(b"mine")
    argv = ["predict", "--model", linear_model, "--input", str(tmp_path / "in.csv"), "--output",
            str(tmp_path / output)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 'afile.pt'} is a file, not a folder" in err, err
    assert (tmp_path / "afile.pt").read_bytes() == b"mine"


@pytest.mark.parametrize("text", ["", "a,b,c\n", "\n\n"])
def test_an_empty_csv_is_one_line_and_no_numpy_warning(tmp_path, capsys, linear_model, text):
    (tmp_path / "in.csv").write_text(text)
    argv = ["predict", "--model", linear_model, "--input", str(tmp_path / "in.csv"), "--output",
            str(tmp_path / "out")]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning numpy would print is an error here
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "in.csv: it holds no instances" in err, err
    assert not (tmp_path / "out").exists()


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
    rows = [json.loads(line) for name in sorted(os.listdir(folder)) if not name.startswith("_")
            for line in open(os.path.join(folder, name))]
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
    # complete (its _SUCCESS holds the summary), and never overwritten
    assert json.load(open(os.path.join(out, "_SUCCESS")))["rows"] == summary["rows"]
    assert sorted(n for n in os.listdir(out) if n.startswith("_")) == ["_SUCCESS"]
    assert main(["predict", "--model", run_dir, "--input", str(folder), "--output", out]) == 2
    assert "already holds a complete prediction (_SUCCESS)" in capsys.readouterr().err


@pytest.mark.integration
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
    assert json.loads(out.read_text("_SUCCESS"))["rows"] == 359 and "_PARTIAL" not in out.list_files()
    rows = sorted((json.loads(line) for name in out.list_files() if not name.startswith("_")
                   for line in out.read_text(name).splitlines()),
                  key=lambda r: r["row"])
    assert np.mean(np.asarray([r["prediction"] for r in rows]) == labels) == pytest.approx(accuracy, abs=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, token: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _ended(proc: subprocess.Popen, seconds: float = 60) -> None:
    """Wait for a server told to stop; kill it if it has not within ``seconds``."""
    try:
        proc.wait(timeout=seconds)
    finally:
        if proc.poll() is None:
            proc.kill()


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def assert_answers_like_batch_prediction(url: str, run: str, raw: np.ndarray, labels: np.ndarray,
                                         accuracy: float) -> None:
    """A torch digits server answers with its run's accuracy, refuses bad requests as such, and
    answers the V2 protocol, Vertex AI's path and concurrent single-instance requests alike."""
    health = json.load(urllib.request.urlopen(url + "/healthz", timeout=30))
    assert health["status"] == "ok" and health["framework"] == "torch"
    code, body = post(url + "/", {"instances": raw.tolist()})
    assert code == 200
    predicted = np.asarray([p["prediction"] for p in body["predictions"]])
    assert np.mean(predicted == labels) == pytest.approx(accuracy, abs=1e-6)
    for bad, message in [(b"{not json", "not JSON"), ({"instances": []}, "instances is empty"),
                         ({"instances": [[1, 2, 3]]}, "each instance must have shape [64]"),
                         ({"instances": [["a"] * 64]}, "must be numbers, got text"),
                         ({"rows": [[0] * 64]}, "instances list"),
                         ({"instances": [[0] * 64] * 2000}, "at most 1024"),
                         ({"instances": [None]}, "instances[0] is null, not a number"),
                         ({"instances": [[0] * 63 + [None]]}, "instances[0][63] is null")]:
        code, answer = post(url + "/predict", bad)
        assert code == 400 and message in answer["error"], (bad if isinstance(bad, bytes) else "", answer)
    # the V2 protocol, its tensor as raw bytes after the JSON, answers the same classes
    rows = raw[:50].astype("<f4")
    head = json.dumps({"inputs": [{"name": "x", "shape": list(rows.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": rows.nbytes}}]}).encode()
    v2 = urllib.request.Request(f"{url}/v2/models/{run}/infer", data=head + rows.tobytes(),
                                headers={"Inference-Header-Content-Length": str(len(head))})
    outputs = {o["name"]: o for o in json.load(urllib.request.urlopen(v2, timeout=60))["outputs"]}
    assert outputs["prediction"]["data"] == predicted[:50].tolist() and outputs["scores"]["shape"] == [50, 10]
    # Vertex AI's path predicts too; other paths and methods are refused as such
    code, answer = post(url + "/v1/models/digits:predict", {"instances": raw[:3].tolist()})
    assert code == 200 and len(answer["predictions"]) == 3
    assert post(url + "/nonexistent", {"instances": raw[:1].tolist()})[0] == 404
    assert get(url + "/predict")[0] == 405 and get(url + "/nonexistent")[0] == 404
    code, answer = post(url + "/predict", b"[" + b"0," * 2_000_000 + b"0]")  # refused before it is parsed
    assert code == 413 and "over" in answer["error"], answer
    # 200 requests from 8 threads, batched by Ray Serve: each answers for its own instance
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: post(url, {"instances": raw[i:i + 1].tolist()}), range(200)))
    assert all(c == 200 for c, _ in answers)
    assert [a["predictions"][0]["prediction"] for _, a in answers] == predicted[:200].tolist()


@pytest.mark.integration
def test_a_regression_run_predicts_its_numbers_as_the_exported_program_does(ray_local, tmp_path, capsys):
    """A managed-loop regression (no classes): `launcher predict` writes each row's number."""
    import torch

    from launcher import JobSpec, run

    spec = JobSpec(workload="examples/diabetes_regression.py:DIABETES", framework="torch", epochs=2, workers=1,
                   storage=str(tmp_path / "runs"), name="diabetes").validated()
    summary = run(spec, show_progress=False)
    assert summary.status == "succeeded", summary.error
    x = np.random.default_rng(0).normal(size=(40, 10)).astype(np.float32)
    np.savetxt(tmp_path / "patients.csv", x, delimiter=",", header=",".join(f"f{i}" for i in range(10)),
               comments="")
    out = str(tmp_path / "preds")
    code = main(["predict", "--model", str(tmp_path / "runs" / "diabetes"), "--input", str(tmp_path / "patients.csv"),
                 "--output", out])
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = sorted((json.loads(line) for name in os.listdir(out) if not name.startswith("_")
                   for line in open(os.path.join(out, name))), key=lambda r: r["row"])
    program = torch.export.load(str(tmp_path / "runs" / "diabetes" / "model" / "model.pt2")).module()
    expected = program(torch.from_numpy(x)).detach().numpy().reshape(-1)
    assert [r["row"] for r in rows] == list(range(40)) and "scores" not in rows[0]
    np.testing.assert_allclose([r["prediction"] for r in rows], expected, rtol=1e-5, atol=1e-6)



def sklearn_digits(folder):
    """A scikit-learn classifier of the digits in ``folder``/model.joblib (as a Vertex AI
    trainer leaves it): (the digits, the model)."""
    import joblib
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    x, y = load_digits(return_X_y=True)
    model = LogisticRegression(max_iter=300).fit(x[:1000], y[:1000])
    folder.mkdir()
    joblib.dump(model, folder / "model.joblib")
    return x, model

@pytest.mark.integration
def test_a_vertex_model_is_served_where_the_aip_variables_say_with_a_token_by_the_replica_itself(tmp_path):
    """What Vertex AI's serving container is told: the model in AIP_STORAGE_URI (a scikit-learn
    model), the port and routes in AIP_*; with --token-file, a request without the token is a 401.
    One replica on the command's own Ray takes HTTP itself (direct ingress: the replica process
    listens on the port, no proxy in between) and answers predictions, limits and metrics; the
    serving line says which way in runs."""
    import psutil

    x, model = sklearn_digits(tmp_path / "model")
    token = "vertex-test-token-0123456789"
    (tmp_path / "token").write_text(token + "\n")
    port = free_port()
    route = "/v1/endpoints/7/deployedModels/9:predict"
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
           "AIP_STORAGE_URI": str(tmp_path / "model"), "AIP_HTTP_PORT": str(port), "AIP_PREDICT_ROUTE": route,
           "AIP_HEALTH_ROUTE": "/health", "AIP_DEPLOYED_MODEL_ID": "9"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "serve.err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--token-file", str(tmp_path / "token")],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    try:
        line = _line_within(proc.stdout, 180)
        assert f"{route}, bearer token required, GET /health" in line, line + (tmp_path / "serve.err").read_text()
        assert "through direct ingress" in line, line
        assert token not in line + (tmp_path / "serve.err").read_text()
        listeners = [c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert len(listeners) == 1 and listeners[0] != proc.pid, listeners
        assert "ServeReplica" in " ".join(psutil.Process(listeners[0]).cmdline()), \
            psutil.Process(listeners[0]).cmdline()
        url = f"http://127.0.0.1:{port}"
        assert json.load(urllib.request.urlopen(url + "/health", timeout=30)) == {"status": "ok"}
        body = {"instances": x[1000:1100].tolist(), "parameters": {}}
        assert post(url + route, body)[0] == 401
        code, answer = post(url + route, body, token=token)
        assert code == 200 and answer["deployedModelId"] == "9"
        assert answer["predictions"] == model.predict(x[1000:1100]).tolist()
        code, answer = post(url + route, {"instances": [[1, 2]]}, token=token)
        assert code == 400 and "each instance must be 64 numbers" in answer["error"], answer
        assert post(url + route, b"[" + b"0," * 2_000_000 + b"0]", token=token)[0] == 413
        assert get(url + "/v2/health/ready")[0] == 200 and get(url + "/nowhere", token)[0] == 404
        code, metrics = get(url + "/metrics", token)
        counted = ((200, 3), (400, 1), (401, 1), (404, 1), (413, 1))  # 200: a prediction and two health checks
        assert code == 200 and all(f'code="{c}"}} {n}' in metrics for c, n in counted), metrics
    finally:
        proc.terminate()  # SIGTERM: the server stops as on Ctrl-C
        _ended(proc)
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.err").read_text()[-3000:]


@pytest.mark.integration
@pytest.mark.timeout(900)  # three servers, two of them on a Ray of their own
def test_bench_serve_sets_launcher_serve_beside_bare_ray_serve_and_one_process(tmp_path):
    """A tiny `launcher bench serve`: every server answers every level without an error, and
    the table, JSON, CSV and plot hold each one's rows with its ratio to bare Ray Serve.
    (ray-serve-direct is ray-serve with Ray Serve's direct-ingress settings: left out here.)"""
    sklearn_digits(tmp_path / "model")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "launcher", "bench", "serve", "--model", str(tmp_path / "model"),
                           "--concurrency", "2", "--instances", "1,8", "--seconds", "0.5", "--restarts", "0",
                           "--servers", "launcher,ray-serve,starlette", "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.load(open(out / "serve.json"))["summary"]
    kinds = ["launcher", "ray-serve", "starlette"]
    assert [(r["server"], r["instances_per_request"]) for r in rows] == [(k, n) for k in kinds for n in (1, 8)]
    assert all(r["requests"] > 0 and r["errors"] == 0 and r["of_ray_serve"] > 0 for r in rows), rows
    assert "of Ray Serve" in done.stdout and "starlette" in done.stdout
    assert len(open(out / "serve.csv").read().splitlines()) == 1 + len(rows)
    assert (out / "serve.png").stat().st_size > 10_000

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


class Server:
    """A `launcher serve` process; its stderr goes to a file (a pipe nobody reads would block it)."""

    def __init__(self, run_dir: str, port: int, env: dict, log_path, *flags: str) -> None:
        self.port = port
        self.log = open(log_path, "a+")
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--model", run_dir, "--port",
                                      str(port), *flags], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=ROOT)

    def ready(self) -> str:
        self.said = self.proc.stdout.readline()
        self.log.seek(0)
        assert "serving" in self.said, self.said + self.log.read()[-3000:]
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.log.close()


def cli(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "serve", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=180)


def hammer(url: str, instances: list, clients: int, per_client: int) -> list[tuple[int, int]]:
    """``clients`` threads, each on one keep-alive connection, send ``per_client`` requests;
    (status, predictions in the answer) for each, or (503, Retry-After seconds) for a 503."""
    import http.client

    body = json.dumps({"instances": instances}).encode()
    host, port = url.rsplit("/", 1)[-1].split(":")

    def client(_: int) -> list[tuple[int, int]]:
        conn, out = http.client.HTTPConnection(host, int(port), timeout=60), []
        for _ in range(per_client):
            conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            answer = r.read()
            if r.status == 503:
                out.append((503, int(r.headers.get("Retry-After", -1))))
                continue
            out.append((r.status, len(json.loads(answer).get("predictions", []))))
        conn.close()
        return out

    with ThreadPoolExecutor(clients) as pool:
        return [item for chunk in pool.map(client, range(clients)) for item in chunk]


def test_a_bare_stop_stops_the_only_server_running(tmp_path, monkeypatch, capsys):
    """`launcher serve --stop` with no --port/--run/--all stops the one server this machine runs
    (SIGTERM, which a real server takes as Ctrl-C and exits 0 on: the integration test below
    stops real servers so, by --port, --run and --all), and says which; nothing running is one
    line."""
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path))
    from launcher.predict import servers

    assert main(["serve", "--stop"]) == 2
    assert "no model server is running on this machine" in capsys.readouterr().err
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        port = free_port()
        servers._write_entry({"pid": sleeper.pid, "port": port, "url": f"http://127.0.0.1:{port}",
                              "model": "/r/digits_torch/model", "run": "digits_torch", "since": 0})
        assert main(["serve", "--stop"]) == 0
        out = capsys.readouterr().out
        assert f"stopped the model server at http://127.0.0.1:{port} (pid {sleeper.pid})" in out, out
        assert sleeper.wait(timeout=10) == -15
        assert servers.listing() == "no model server is running on this machine"
    finally:
        sleeper.kill()


@pytest.mark.integration
def test_servers_answer_like_batch_prediction_batch_under_load_stop_one_by_one_and_restart_at_once(
        models, test_split, tmp_path):
    """A torch and a TensorFlow model served at once, each answering with its run's accuracy; the
    torch one refuses bad requests as such (assert_answers_like_batch_prediction); 32 concurrent
    keep-alive clients share forward passes (more than Ray Serve's default of 5 requests per
    replica); the two servers are listed and stopped one by one; a server stopped under
    keep-alive load starts again on its port at once. (One test: each `launcher serve` start
    costs a Ray of its own. `launcher serve --stop` with one server running is checked without
    Ray: test_a_bare_stop_stops_the_only_server_running.)"""
    run_dir, accuracy = models["torch"]
    tf_dir, tf_accuracy = models["tensorflow"]
    _, raw, labels = test_split
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    first, second = free_port(), free_port()
    a = Server(run_dir, first, env, tmp_path / "a.err", "--batch-wait-ms", "20")
    b = Server(tf_dir, second, env, tmp_path / "b.err")
    servers = [a, b]
    try:
        url_a, url_b = a.ready(), b.ready()
        # the TensorFlow model answers as its run measured it (the torch one: below)
        assert json.load(urllib.request.urlopen(url_b + "/healthz", timeout=30))["framework"] == "tensorflow"
        code, body = post(url_b + "/", {"instances": raw.tolist()})
        predicted = np.asarray([p["prediction"] for p in body["predictions"]])
        assert code == 200 and np.mean(predicted == labels) == pytest.approx(tf_accuracy, abs=1e-6)
        answers = hammer(url_a, raw[:2].tolist(), clients=32, per_client=10)
        assert answers == [(200, 2)] * 320
        _, metrics = get(url_a + "/metrics")
        largest = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("launcher_serve_batch_requests_largest"))
        assert largest > 5, metrics  # Ray Serve's default max_ongoing_requests (5) capped batches at 5
        assert 'launcher_serve_requests_total{replica=' in metrics and 'code="200"} 320' in metrics
        # after the counts above: what it answers and refuses (none of it a POST /predict of 2 instances
        # answered with 200, so the access log's count below stays the load's)
        assert_answers_like_batch_prediction(url_a, "digits_torch", raw, labels, accuracy)

        listed = cli(env, "--list")
        assert listed.returncode == 0 and f"{first} " in listed.stdout and f"{second} " in listed.stdout, listed
        assert "digits_torch" in listed.stdout and "digits_tensorflow" in listed.stdout
        ambiguous = cli(env, "--stop")
        assert ambiguous.returncode == 2 and "2 model servers are running" in ambiguous.stderr, ambiguous
        stopped = cli(env, "--stop", "--port", str(first))
        assert stopped.returncode == 0 and f"stopped the model server at http://127.0.0.1:{first}" in stopped.stdout, \
            stopped
        assert a.proc.wait(timeout=60) == 0
        assert get(url_b + "/healthz")[0] == 200  # the other one still serves
        assert str(first) not in cli(env, "--list").stdout

        # stop b while 16 keep-alive clients keep it busy, then start it again on its port
        import threading

        load = threading.Thread(target=lambda: _ignore_errors(hammer, url_b, raw[:1].tolist(), 16, 40))
        load.start()
        time.sleep(1.0)
        assert cli(env, "--stop", "--run", "digits_tensorflow").returncode == 0
        load.join()
        assert b.proc.wait(timeout=60) == 0
        again = Server(tf_dir, second, env, tmp_path / "b2.err", "--max-batch", "1", "--max-queued", "2")
        servers.append(again)
        url = again.ready()  # at once, on the same port
        # The old connections, where some are still in TIME_WAIT (most runs here, not all), keep a
        # direct-ingress replica off the port: the proxy takes it then, and says why.
        assert ("proxy" in again.said) == ("TIME_WAIT" in again.said), again.said
        # sized for 2 requests (and 2 more at a proxy): past that a 503 with Retry-After, at once
        answers = hammer(url, raw[:1].tolist(), clients=32, per_client=5)
        assert set(answers) <= {(200, 1), (503, 1)} and (503, 1) in answers and (200, 1) in answers, answers
        assert cli(env, "--stop", "--all").returncode == 0
        assert again.proc.wait(timeout=60) == 0
        # one access-log line per request, in the run's folder
        log = open(os.path.join(run_dir, "serve", f"access-{first}.log")).read().splitlines()
        assert sum(" POST /predict 200 2 " in line for line in log) == 320
    finally:
        for s in servers:
            s.close()


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the server goes away under this load on purpose
        pass


def _line_within(stream, seconds: float) -> str:
    """The next line of a child's pipe, failing the test (not hanging it) after ``seconds``."""
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no output within {seconds:.0f} s"
    return stream.readline()


@pytest.mark.integration
def test_an_interrupted_predict_leaves_no_output_that_looks_complete(models, tmp_path):
    """Ctrl-C at several moments: the folder then holds a complete prediction (_SUCCESS, every
    row, exit 0) or an unfinished one (no _SUCCESS, exit 130, its _PARTIAL marker), which the
    same command replaces. The command is run again on the last unfinished folder only (each
    run starts a Ray of its own): what it replaces is decided from the folder's markers alone,
    the same whatever the moment, and each state an interrupt leaves is checked without Ray by
    test_an_unfinished_prediction_is_replaced_whatever_it_holds_and_a_complete_one_never."""
    import signal

    run_dir, _ = models["torch"]
    rows = 60_000
    np.save(tmp_path / "many.npy", np.random.default_rng(0).uniform(0, 16, (rows, 64)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    unfinished = []
    for moment, delay in enumerate((0.0, 4.0)):  # while Ray starts, and while it predicts (or after)
        out = tmp_path / f"out{moment}"
        argv = [sys.executable, "-m", "launcher", "predict", "--model", run_dir, "--input", str(tmp_path / "many.npy"),
                "--output", str(out)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        try:
            first = _line_within(proc.stderr, 120)
            assert "predicting 1 file(s)" in first, first
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:  # a failed check must not leave a predict behind to slow the next tests
                proc.kill()
                proc.communicate()
        stderr = first + stderr
        if (out / "_SUCCESS").exists():
            assert proc.returncode == 0, stderr
            assert json.load(open(out / "_SUCCESS"))["rows"] == rows and "predicted 60000 rows" in stdout
            assert sum(len(v) for v in read_predictions(str(out)).values()) == rows
            continue
        assert proc.returncode == 130, stderr
        assert "is unfinished (_PARTIAL, no _SUCCESS): the same command replaces it" in stderr, stderr
        # what it left is one of the states the fast test has the same command replace
        left = os.listdir(out)
        assert "_PARTIAL" in left and "_SUCCESS" not in left, left
        unfinished.append((argv, out))
    assert unfinished, "every interrupt came too late to test an unfinished output"
    argv, out = unfinished[-1]
    again = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "held the partial output of an interrupted predict" in again.stderr, again
    assert json.load(open(out / "_SUCCESS"))["rows"] == rows
    assert sum(len(v) for v in read_predictions(str(out)).values()) == rows  # nothing twice
    assert sorted(n for n in os.listdir(out) if n.startswith("_")) == ["_SUCCESS"]


def test_an_unfinished_prediction_is_replaced_whatever_it_holds_and_a_complete_one_never(tmp_path):
    """What an interrupted predict can leave, by moment: its _PARTIAL marker alone (while Ray
    starts), with Ray Data's staging folder (while it writes), with some files already moved up
    (while it finishes), or the staging folder alone. The next predict into the folder empties
    each (and says so) before it writes; a complete prediction (_SUCCESS) or files of unknown
    origin are refused, untouched."""
    from launcher.errors import UserError
    from launcher.predict.batch import PARTIAL, STAGING, SUCCESS, prepare_output
    from launcher.storage import Storage
    from launcher.storage.uri import normalize_storage

    def at(folder) -> Storage:  # as predict resolves --output
        return Storage.resolve(normalize_storage(str(folder)))

    moved = {"part-0.json": '{"row": 0}\n'}
    staged = {f"{STAGING}/part-1.json": '{"row": 1}\n'}
    for name, files in {"partial": {PARTIAL: "{}"}, "staging": {PARTIAL: "{}", **staged},
                        "finishing": {PARTIAL: "{}", **moved, **staged}, "staging-only": staged}.items():
        folder = tmp_path / name
        for path, text in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        said = prepare_output(at(folder), f"out/{name}")
        assert said == (f"--output out/{name} held the partial output of an interrupted predict (no {SUCCESS}): "
                        "replacing it"), said
        assert not folder.exists() or os.listdir(folder) == [], (name, os.listdir(folder))
    assert prepare_output(at(tmp_path / "new"), "out/new") is None

    for name, files, message in (("complete", {SUCCESS: "{}", PARTIAL: "{}", **moved}, "already holds a complete"),
                                 ("theirs", {"notes.txt": "mine"}, "already holds files")):
        folder = tmp_path / name
        folder.mkdir()
        for path, text in files.items():
            (folder / path).write_text(text)
        with pytest.raises(UserError, match=message):
            prepare_output(at(folder), f"out/{name}")
        assert sorted(os.listdir(folder)) == sorted(files)
