"""Cloud Storage tests against a real emulator (fake-gcs-server) on loopback.

Storage checks, data upload and the per-node data cache need no Ray; the
training tests run 2 workers on the shared local Ray with gs:// storage.
"""

from __future__ import annotations

import http.server
import json
import os
import threading

import pytest

from datafiles import write_mnist_idx
from launcher.storage import datacache
from launcher.storage import gcs as launcher_gcs
from launcher.storage.checkpoint import complete_checkpoints
from launcher.cli.main import main
from launcher.errors import UserError
from launcher.spec import JobSpec
from launcher.storage import Storage

pytestmark = pytest.mark.gcs


@pytest.mark.parametrize("uri,needle", [
    ("gs:/bucket/x", "looks like a URI but is malformed"),
    ("gs://", "names no bucket"),
    ("gs:///prefix", "names no bucket"),
    ("gs://Bad_Bucket!/x", "is not a valid bucket name"),
    ("s3://bucket/x", "s3:// scheme is not supported"),
])
def test_malformed_storage_uris(uri, needle):
    with pytest.raises(UserError, match=needle):
        JobSpec(storage=uri).validated()


def test_storage_check_reports_location_and_writes_nothing(gcs, bucket):
    _, client = gcs
    storage = Storage.resolve(f"gs://{bucket}/team/runs")
    assert storage.check_writable() == f"gs://{bucket}/team/runs (bucket location EUROPE-WEST4)"
    assert list(client.list_blobs(bucket)) == []  # the marker was deleted


def test_missing_bucket_is_one_clear_line(gcs, capsys, tmp_path):
    code = main(["run", "--storage", "gs://no-such-bucket-here/runs"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "cannot use gs://no-such-bucket-here/runs: the bucket does not exist" in err


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """Answers every Cloud Storage call with 403, as the real service does without IAM rights."""

    def _deny(self) -> None:
        body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.buckets.get access",
                                     "errors": [{"reason": "forbidden"}]}}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _deny

    def log_message(self, *args) -> None:
        pass


def test_permission_denied_is_one_clear_line(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(UserError, match=r"cannot use gs://locked/runs: permission denied; grant"):
            Storage.resolve("gs://locked/runs").check_writable()
    finally:
        server.shutdown()


class _Unavailable(_Forbidden):
    """Answers every call with 503, as an overloaded or failing service does."""

    def _deny(self) -> None:
        body = b'{"error": {"code": 503, "message": "backend unavailable"}}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _deny


def test_storage_outage_is_not_bad_input(monkeypatch, capsys):
    # A service that keeps failing is an outage: exit 1, one line naming what did not answer.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("LAUNCHER_GCS_RETRY_S", "2")
        code = main(["run", "--storage", "gs://busy/runs"])
    finally:
        server.shutdown()
    lines = capsys.readouterr().err.strip().splitlines()
    # at the first retry, a line says what does not answer and for how long it will be tried
    assert code == 1 and len(lines) == 2, lines
    assert lines[0].startswith("launcher: the Cloud Storage emulator at http://127.0.0.1:") and \
        lines[0].endswith("did not answer (ServiceUnavailable); retrying for up to 2s (LAUNCHER_GCS_RETRY_S sets it)")
    err = lines[1]
    assert err.startswith("error: cannot use gs://busy/runs: the Cloud Storage emulator at http://127.0.0.1:")
    assert "(STORAGE_EMULATOR_HOST) did not answer (HTTP 503; retried for 2s" in err and "unset STORAGE_EMULATOR_HOST" in err
    assert "RetryError" not in err and "exceeded" not in err  # what happened, not the library's words


def test_upload_and_cached_download(gcs, bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(datacache.CACHE_ENV, str(tmp_path / "cache"))
    folder = write_mnist_idx(str(tmp_path / "mnist"), n_train=50, n_test=20, gz=True)
    assert main(["data", "upload", folder, f"gs://{bucket}/datasets/mnist"]) == 0
    uri = capsys.readouterr().out.strip()
    assert uri == f"gs://{bucket}/datasets/mnist"

    notes: list[str] = []
    local = datacache.local_data(uri, notes.append)
    assert sorted(os.listdir(local)) == sorted(os.listdir(folder))
    for name in os.listdir(folder):
        assert open(os.path.join(local, name), "rb").read() == open(os.path.join(folder, name), "rb").read()
    assert len(notes) == 4
    datacache.local_data(uri, notes.append)
    assert len(notes) == 4  # second time: verified copies, nothing downloaded

    victim = os.path.join(local, "train-images-idx3-ubyte.gz")
    with open(victim, "r+b") as f:
        f.truncate(10)  # a copy cut off (or damaged) on this node
    datacache.local_data(uri, notes.append)
    assert len(notes) == 5 and "train-images-idx3-ubyte.gz" in notes[-1]
    assert os.path.getsize(victim) == os.path.getsize(os.path.join(folder, "train-images-idx3-ubyte.gz"))

    single = tmp_path / "mnist.npz"
    single.write_bytes(b"not really npz")
    assert main(["data", "upload", str(single), f"gs://{bucket}/one"]) == 0
    assert capsys.readouterr().out.strip() == f"gs://{bucket}/one/mnist.npz"
    assert open(datacache.local_data(f"gs://{bucket}/one/mnist.npz"), "rb").read() == b"not really npz"

    with pytest.raises(UserError, match="no objects there.*launcher data upload"):
        datacache.local_data(f"gs://{bucket}/nothing-here")


@pytest.mark.integration
def test_train_resume_and_list_on_gcs(ray_local, gcs, bucket, capsys, tmp_path, monkeypatch):
    _, client = gcs
    monkeypatch.setenv(datacache.CACHE_ENV, str(tmp_path / "cache"))
    folder = write_mnist_idx(str(tmp_path / "mnist"), n_train=1200, n_test=300, gz=True)
    assert main(["data", "upload", folder, f"gs://{bucket}/data/mnist"]) == 0
    data = capsys.readouterr().out.strip()
    root = f"gs://{bucket}/runs"
    common = ["run", "--json", "--workload", "mnist-mlp", "--data", data, "--storage", root, "--name", "on_gcs"]

    assert main([*common, "--epochs", "1"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["status"] == "succeeded" and first["checkpoint"].startswith(f"{root}/on_gcs/checkpoint_")

    # A newer checkpoint whose upload was cut off: its manifest is there, its weights are not.
    storage = Storage.resolve(root)
    good = complete_checkpoints(storage, "on_gcs")[-1][1]
    manifest = json.loads(storage.fs.open_input_stream(f"{good}/manifest.json").read())
    manifest["global_step"] += 1000
    manifest["epoch"] += 5
    cut = client.bucket(bucket)
    cut.blob("runs/on_gcs/checkpoint_9999-cut/manifest.json").upload_from_string(json.dumps(manifest))
    cut.blob("runs/on_gcs/checkpoint_9999-cut/model.pt").upload_from_string(b"partial")

    mlruns = str(tmp_path / "mlruns")
    assert main([*common, "--epochs", "2", "--mlflow", mlruns]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["resumed_from"] == {"epoch": 1, "step": first["steps_completed"]}
    assert resumed["epochs_completed"] == 2 and resumed["metrics"]["accuracy"] >= 0.8
    names = {b.name for b in client.list_blobs(bucket, prefix="runs/on_gcs/")}
    for expected in ("run.json", "launches.jsonl", "metrics.jsonl", "summary.json", "model/model.pt2"):
        assert f"runs/on_gcs/{expected}" in names
    assert any(n.startswith("runs/on_gcs/tensorboard/events.out.tfevents") for n in names)
    # each rank's output, uploaded per launch, and shown by `launcher logs` from the bucket
    for launch in (1, 2):
        ranks = sorted(n.rsplit("-", 1)[1] for n in names if n.startswith(f"runs/on_gcs/logs/launch{launch}/"))
        assert ranks == ["rank0.log", "rank1.log"], names
    assert main(["logs", "on_gcs", "--storage", root, "--rank", "1"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown and all(line.startswith("[rank 1] ") for line in shown if line.strip())
    assert any("=== rank 1, worker group started" in line for line in shown)
    # --mlflow with the run on gs://: its model, downloaded from the bucket, is the MLflow run's artifact
    from mlflow.tracking import MlflowClient

    tracking = MlflowClient(f"sqlite:///{mlruns}/mlflow.db")
    (tracked,) = tracking.search_runs([e.experiment_id for e in tracking.search_experiments()])
    assert tracked.data.tags["launcher.run_dir"] == f"{root}/on_gcs"
    assert {a.path for a in tracking.list_artifacts(tracked.info.run_id, "model")} >= {"model/model.pt2"}

    assert main(["runs", "--storage", root, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["epochs"], r["launches"]) for r in runs] == [("on_gcs", "succeeded", 2, 2)]
    assert runs[0]["checkpoint"] == resumed["checkpoint"]
    assert launcher_gcs.emulator_host() is not None


def test_transient_outage_is_retried(gcs, bucket, tmp_path, capsys):
    """The emulator goes away for two seconds in the middle of the work: the upload still completes."""
    emulator, client = gcs
    folder = tmp_path / "files"
    folder.mkdir()
    for i in range(3):
        (folder / f"part{i}.bin").write_bytes(os.urandom(1024) * (i + 1))
    emulator.stop()
    restarter = threading.Timer(2.0, emulator.start)
    restarter.start()
    try:
        assert main(["data", "upload", str(folder), f"gs://{bucket}/flaky"]) == 0
    finally:
        restarter.join()
    assert capsys.readouterr().out.strip() == f"gs://{bucket}/flaky"
    sizes = {b.name: b.size for b in client.list_blobs(bucket, prefix="flaky/")}
    assert sizes == {f"flaky/part{i}.bin": 1024 * (i + 1) for i in range(3)}


def test_the_emulator_a_user_starts_by_hand_serves_its_buckets_until_stopped(tmp_path, monkeypatch):
    """docs/guides/cloud-storage.md's command for one's own tries (issue 65 item 7): the emulator in the
    foreground with the bucket asked for, the variable to export on its first line; SIGTERM (or
    Ctrl-C) stops it and the server under it."""
    import signal
    import subprocess
    import sys

    from launcher.lab.gcs_emulator import free_port

    guide = open(os.path.join(os.path.dirname(__file__), "..", "docs", "guides", "cloud-storage.md")).read()
    assert "python -m launcher.lab.gcs_emulator --bucket my-bucket" in guide
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher.lab.gcs_emulator", "--port", str(port), "--root",
                             str(tmp_path / "objects"), "--bucket", "tries"], stdout=subprocess.PIPE, text=True)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert f"Cloud Storage emulator at http://127.0.0.1:{port} (buckets: tries;" in first, first
        assert second.strip() == f"export STORAGE_EMULATOR_HOST=http://127.0.0.1:{port}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        local = tmp_path / "table.csv"
        local.write_text("a,b\n1,2\n")
        assert datacache.upload(str(local), "gs://tries/data", show_progress=False) == "gs://tries/data/table.csv"
        assert [b.name for b in launcher_gcs.client().list_blobs("tries")] == ["data/table.csv"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    with pytest.raises(Exception):  # the server went with it
        import urllib.request

        urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b", timeout=2)
