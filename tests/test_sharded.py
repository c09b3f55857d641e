"""Sharded training (``--strategy fsdp``): FSDP2 models, DCP checkpoints, resuming on another
worker count, the exported whole model.

The fast tests check the refusals (one line each), how a model is cut into blocks, and the
checkpoint files (a DCP folder written by one process: the sizes its metadata gives, and the
export to one file that loads into the model's own class). The integration tests train
examples/char_lm.py sharded over 2 workers, stop it with Ctrl-C right after a mid-epoch
checkpoint stored in the background and resume it on 2 (the same final weights as the
uninterrupted run) and a copy on 3 workers (from the same step, the same global batches,
losses within float tolerance); and a managed run on gs:// resumes from its shards, exports
them as one file and predicts with the model it exported.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from launcher.errors import UserError
from launcher.spec import JobSpec
from test_session import CHAR_LM, ROOT, epoch_records, finish, launch, stop_after_step_checkpoint, topics_file


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,needles", [
    ({"backend": "horovod"}, ["native torch backend, not horovod", "drop --backend horovod"]),
    ({"framework": "tensorflow"}, ["shards a PyTorch model", "TensorFlow runs are data parallel"]),
    ({"precision": "fp16"}, ["fp16", "use --precision bf16"]),
    ({"fsdp_offload": True}, ["workers have no GPU", "--gpus-per-worker"]),
    ({"strategy": "zero3"}, ["unknown strategy 'zero3'", "valid: ddp, fsdp"]),
])
def test_a_strategy_that_cannot_run_is_refused_in_one_line(fields, needles):
    fields = {"strategy": "fsdp", **fields}
    with pytest.raises(UserError) as caught:
        JobSpec(**fields).validated()
    text = str(caught.value)
    for needle in needles:
        assert needle in text, text


def test_offload_without_fsdp_is_refused():
    with pytest.raises(UserError, match="applies to --strategy fsdp"):
        JobSpec(fsdp_offload=True).validated()


def test_fsdp_with_horovod_on_the_command_line_exits_2_before_ray(capsys):
    from launcher.cli.main import main

    assert main(["run", "--strategy", "fsdp", "--backend", "horovod"]) == 2
    err = capsys.readouterr().err
    assert "native torch backend, not horovod" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


def test_a_script_program_is_not_sharded_by_the_launcher(capsys, tmp_path):
    from launcher.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["run", "--script", str(script), "--strategy", "fsdp"]) == 2
    assert "program prepares its own" in capsys.readouterr().err


# -- blocks -------------------------------------------------------------------------------------

def small_gpt():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class GPT(nn.Module):
        def __init__(self, d=32, layers=4, vocab=50):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, x):
            x = self.embed(x)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    return GPT(), Block


def test_the_default_blocks_are_the_transformer_blocks_and_the_large_leaves():
    from launcher.worker.sharded import default_blocks

    model, Block = small_gpt()
    chosen = default_blocks(model)
    assert [b for b in chosen if isinstance(b, Block)] == list(model.blocks)  # each block, not the list
    assert model.embed in chosen and model.head in chosen
    assert model.norm not in chosen and model not in chosen  # a tiny norm stays with the root


def test_named_blocks_take_classes_or_modules_and_refuse_strangers():
    import torch.nn as nn

    from launcher.worker.loader import SessionError
    from launcher.worker.sharded import named_blocks

    model, Block = small_gpt()
    assert named_blocks(model, [Block]) == list(model.blocks)
    assert named_blocks(model, [model.head, Block]) == [model.head, *model.blocks]
    with pytest.raises(SessionError, match="has no Conv2d module"):
        named_blocks(model, [nn.Conv2d])
    with pytest.raises(SessionError, match="not a submodule"):
        named_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(SessionError, match="neither a module class nor a module"):
        named_blocks(model, ["blocks"])


# -- checkpoint files ---------------------------------------------------------------------------

def test_a_dcp_folder_lists_its_files_and_exports_one_model_file(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from launcher.worker.sharded import METADATA, export_file, shard_files

    model, _ = small_gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    optimizer.step()
    folder = str(tmp_path / "ckpt")
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
             storage_writer=dcp.FileSystemWriter(folder, thread_count=1), no_dist=True)

    files = shard_files(folder)
    on_disk = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
    assert files == on_disk and METADATA in files and len(files) >= 2

    out = export_file(folder, "model", str(tmp_path / "model.pt"))
    state = torch.load(out)
    fresh, _ = small_gpt()
    fresh.load_state_dict(state)  # the user's own class takes it
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_the_export_skeleton_holds_no_weights_until_the_whole_state_is_loaded():
    """What rank 0 keeps before sharding for the export: the model's own classes on the meta
    device (its non-persistent buffers kept), then the gathered state assigned into it."""
    import torch

    from launcher.worker.sharded import load_skeleton, skeleton

    model, Block = small_gpt()
    model.register_buffer("scale", torch.full((1,), 2.0), persistent=False)  # in no state_dict
    clone = skeleton(model)
    assert type(clone) is type(model) and isinstance(clone.blocks[0], Block)
    assert all(p.is_meta for p in clone.parameters()) and torch.equal(clone.scale, model.scale)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    loaded, why = load_skeleton(clone, whole)
    assert why is None and loaded.embed.weight.data_ptr() == whole["embed.weight"].data_ptr()  # no copy
    x = torch.randint(0, 50, (3, 7))
    assert torch.equal(loaded(x), model(x))
    missing, why = load_skeleton(skeleton(model), {k: v for k, v in whole.items() if k != "head.bias"})
    assert missing is None and "do not fit the model" in why and "head.bias" in why, why


# -- training -----------------------------------------------------------------------------------

@pytest.mark.integration
def test_char_lm_sharded_resumes_exactly_on_2_and_from_the_same_step_on_3(warm_head, tmp_path):
    storage = str(tmp_path / "runs")
    data = topics_file(tmp_path / "data")
    # A global batch of 12 samples: 6 on each of 2 workers, 4 on each of 3. One epoch (about 24
    # steps): the stop comes at step 5, so each resumed run trains the rest of it, after which the
    # final weights (on 2) and the epoch's losses (on 3) are compared; a second epoch repeated those
    # checks at twice the training in each of the three whole or resumed launches.
    base = ["--workload", CHAR_LM, "--data", data, "--storage", storage, "--strategy", "fsdp",
            "--epochs", "1", "--param", "max_chars=20000"]
    whole = finish(launch(base + ["--workers", "2", "--batch-size", "6", "--name", "whole"]))  # no step checkpoints
    base += ["--checkpoint-every-steps", "5"]
    two = base + ["--workers", "2", "--batch-size", "6"]
    assert whole["status"] == "succeeded", whole
    steps = whole["steps_completed"]
    manifest = json.load(open(os.path.join(whole["checkpoint"], "manifest.json")))
    assert manifest["strategy"] == "fsdp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"]), manifest["files"]

    # Stopped after a step checkpoint stored in the background (DCP's asynchronous save); a copy of
    # the stopped run is resumed on 3 workers, the run itself on 2.
    stopped = stop_after_step_checkpoint(two + ["--name", "same", "--checkpoint-upload", "async"], tmp_path)
    assert stopped["status"] == "cancelled" and stopped["steps_completed"] < steps, stopped
    shutil.copytree(os.path.join(storage, "same"), os.path.join(storage, "grown"),
                    ignore=shutil.ignore_patterns("checkpoint_manager_snapshot.json"))
    resumed = finish(launch(two + ["--name", "same"]))
    assert resumed["resumed_from"] == {"epoch": 0, "step": 5}, resumed
    assert resumed["status"] == "succeeded" and resumed["steps_completed"] == steps
    assert resumed["weights_sha256"] == whole["weights_sha256"]

    three = finish(launch(base + ["--workers", "3", "--batch-size", "4", "--name", "grown"]))
    assert three["resumed_from"] == {"epoch": 0, "step": 5}, three
    assert three["status"] == "succeeded" and three["steps_completed"] == steps, three
    metrics = ["train_loss", "val_loss"]
    expected, got = epoch_records(storage, "whole", metrics), epoch_records(storage, "grown", metrics)
    for epoch, values in expected.items():  # the same samples in the same global batches: float error only
        # (the interrupted epoch's train_loss too: the 2 ranks' sums so far carry over to the 3)
        assert got[epoch] == pytest.approx(values, rel=2e-3), (epoch, got, expected)


@pytest.mark.integration
def test_a_sharded_run_on_gcs_resumes_exports_and_predicts(ray_local, gcs, bucket, capsys, tmp_path, monkeypatch):
    """gs:// storage: every rank's shards reach the bucket (in the background with async upload),
    the next launch reads them back as its sharded model is registered, the export joins them,
    and the model the run exported predicts with the run's accuracy."""
    import torch

    from launcher.cli.main import main

    root = f"gs://{bucket}/runs"
    common = ["run", "--json", "--workload", "digits-mlp", "--storage", root, "--name", "sharded_gcs",
              "--strategy", "fsdp", "--checkpoint-upload", "async", "--checkpoint-every-steps", "10"]
    assert main([*common, "--epochs", "1"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["status"] == "succeeded", first
    assert main([*common, "--epochs", "2"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["resumed_from"] == {"epoch": 1, "step": first["steps_completed"]}, resumed
    assert resumed["status"] == "succeeded" and resumed["metrics"]["accuracy"] > 0.8, resumed

    monkeypatch.chdir(tmp_path)
    assert main(["checkpoint", "export", "sharded_gcs", "--storage", root, "--out", "digits.pt"]) == 0
    exported = torch.load(tmp_path / "digits.pt")
    from workloads import get
    get("digits-mlp").torch_model({}).load_state_dict(exported)

    split = get("digits-mlp").load(None, "test", 0, 1, {})
    folder = tmp_path / "in"
    folder.mkdir()
    np.save(folder / "test.npy", split.x * 16.0)
    out = str(tmp_path / "preds")
    # (a local copy of the run: this Ray's workers started before the emulator's address was set)
    from launcher.storage import Storage
    (tmp_path / "run" / "model").mkdir(parents=True)
    Storage.resolve(root).download_dir(str(tmp_path / "run" / "model"), "sharded_gcs", "model")
    assert main(["predict", "--model", str(tmp_path / "run"), "--input", str(folder), "--output", out]) == 0
    rows = [json.loads(line) for name in sorted(os.listdir(out)) if not name.startswith("_")
            for line in open(os.path.join(out, name))]
    predicted = np.array([r["prediction"] for r in sorted(rows, key=lambda r: r["row"])])
    assert np.mean(predicted == split.y) == pytest.approx(resumed["metrics"]["accuracy"], abs=1e-6)


GPT = os.path.join(ROOT, "examples", "gpt.py") + ":train"


@pytest.mark.integration
def test_a_sharded_training_functions_model_is_predicted_and_served_as_its_own_class_computes(
        warm_head, ray_local, tmp_path, monkeypatch, capsys):
    """examples/gpt.py (tiny) trained with --strategy fsdp on 2 workers exports a program, not
    weights only: `launcher predict --run` and a real `launcher serve` answer what the user's own
    class, holding the exported weights, computes. (The predict runs in this process, on the
    session's Ray, as test_predict.py's do: a `launcher predict` process would start a Ray of
    its own first.)"""
    import importlib

    import torch

    from launcher.cli.main import main
    from test_predict import Server, _ended, cli, free_port, post

    storage = str(tmp_path / "runs")
    done = finish(launch(["--workload", GPT, "--data", topics_file(tmp_path / "data"), "--storage", storage,
                          "--name", "gpt", "--strategy", "fsdp", "--workers", "2", "--epochs", "1",
                          "--batch-size", "8", "--param", "d_model=32", "--param", "layers=2", "--param", "heads=2",
                          "--param", "context=16", "--param", "max_chars=3000", "--param", "eval_batches=1"]))
    assert done["status"] == "succeeded" and done["strategy"] == "fsdp", done
    assert done["model"] and not done["model_note"], done
    model_dir = os.path.join(storage, "gpt", "model")
    assert {"model.pt2", "state_dict.pt", "model.json"} <= set(os.listdir(model_dir))

    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))  # gpt.py imports char_lm beside it
    state = torch.load(os.path.join(model_dir, "state_dict.pt"))
    vocab = state["tokens.weight"].shape[0]
    net = importlib.import_module("gpt").GPT(vocab, 16, 32, 2, 2)
    net.load_state_dict(state)
    ids = torch.randint(0, vocab, (5, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = net.eval()(ids).numpy()

    (tmp_path / "ids.jsonl").write_text(json.dumps({"instances": ids.tolist()}) + "\n")
    # No warm head from here on: the predict takes the session's Ray, the server starts its own.
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code = main(["predict", "--run", "gpt", "--storage", storage, "--input", str(tmp_path / "ids.jsonl"),
                 "--output", str(tmp_path / "preds")])
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = sorted((json.loads(line) for name in os.listdir(tmp_path / "preds") if not name.startswith("_")
                   for line in open(tmp_path / "preds" / name)), key=lambda r: r["row"])
    np.testing.assert_allclose([r["prediction"] for r in rows], expected, rtol=1e-4, atol=1e-5)

    server = Server(os.path.join(storage, "gpt"), free_port(), env, tmp_path / "serve.err")
    try:
        code, answer = post(server.ready() + "/predict", {"instances": ids.tolist()})
        assert code == 200, answer
        np.testing.assert_allclose(answer["predictions"], expected, rtol=1e-4, atol=1e-5)
    finally:
        stopped = cli(env, "--stop")
        _ended(server.proc)  # killed only if the stop did not end it
        server.close()
    assert stopped.returncode == 0 and "stopped the model server" in stopped.stdout, stopped


def test_a_model_without_parameters_is_refused_before_any_collective():
    import torch

    from launcher.worker.loader import SessionError
    from launcher.worker.sharded import shard

    with pytest.raises(SessionError, match="has no parameters, so there is nothing to shard"):
        shard(torch.nn.ReLU(), None, device=torch.device("cpu"), precision="fp32", offload=False)


def test_resuming_with_the_other_strategy_is_one_line_before_ray(tmp_path, capsys):
    from launcher.cli.main import main
    from launcher.storage.checkpoint import Manifest, write_manifest

    folder = tmp_path / "runs" / "mixed" / "checkpoint_000001"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    write_manifest(str(folder), Manifest(epoch=1, step_in_epoch=0, global_step=46, world_size=2, framework="torch",
                                         backend="native", workload="digits-mlp", batch_size=32, seed=0))
    assert main(["run", "--storage", str(tmp_path / "runs"), "--name", "mixed", "--strategy", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert "written with --strategy ddp, not fsdp" in err and "resume with --strategy ddp" in err, err
    assert "Traceback" not in err and "starting" not in err
