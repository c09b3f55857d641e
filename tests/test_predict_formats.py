"""Model formats predict and serve load (no Ray): each kind of model answers as the model
called directly does, bad instances are one clear line, and a folder nothing can load is
refused before anything starts. The server's routing, tokens and Vertex AI's variables are
checked on a real Starlette request."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import pickle

import joblib
import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from launcher.errors import UserError
from launcher.predict import endpoint as replica
from launcher.predict.formats.instances import INPUT
from launcher.predict.formats.tensorflow import tensorflow
from launcher.predict.model import Model, locate


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return x, y


def loaded(folder) -> Model:
    return Model(locate(str(folder)))


def test_a_scikit_learn_package_model_answers_as_its_predict(tmp_path, digits):
    x, y = digits
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(x[:1200], y[:1200])
    joblib.dump(model, tmp_path / "model.joblib")
    served = loaded(tmp_path)
    assert served.ref.format == "sklearn" and served.about()["features"] == 64
    assert served.predict(x[1200:].tolist()) == model.predict(x[1200:]).tolist()
    with pytest.raises(ValueError, match=r"each instance must be 64 numbers \(the Pipeline's features\), got 3"):
        served.inputs([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"instances\[1\]\[2\] is null, not a number"):
        served.inputs([[0] * 64, [0, 0, None] + [0] * 61])

    # model.pkl, a regression: numbers come back as numbers
    (tmp_path / "model.joblib").unlink()
    regression = LinearRegression().fit(x[:, :4], x[:, 5])
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(regression))
    served = loaded(tmp_path)
    answers = served.predict(x[:5, :4].tolist())
    assert all(isinstance(a, float) for a in answers)
    np.testing.assert_allclose(answers, regression.predict(x[:5, :4]), rtol=1e-5)


def test_an_xgboost_booster_answers_as_its_predict_and_a_runs_classifier_with_classes(tmp_path, digits):
    import xgboost as xgb

    x, y = digits
    binary = (y == 3).astype(np.float32)
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 3}, xgb.DMatrix(x, label=binary), 10)
    (tmp_path / "model.bst").write_bytes(bytes(booster.save_raw("ubj")))
    served = loaded(tmp_path)
    assert served.ref.format == "xgboost" and served.about()["features"] == 64
    expected = booster.predict(xgb.DMatrix(x[:20]))
    np.testing.assert_allclose(served.predict(x[:20].tolist()), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="must be numbers, got text"):
        served.inputs([["a"] * 64])

    # a run's export names the objective and classes: the class and both scores
    (tmp_path / "model.json").write_text(json.dumps({"workload": "xgboost-function", "framework": "xgboost",
                                                     "objective": "binary:logistic", "num_classes": 2}))
    answers = loaded(tmp_path).predict(x[:20].tolist())
    assert [a["prediction"] for a in answers] == (expected > 0.5).astype(int).tolist()
    np.testing.assert_allclose([a["scores"][1] for a in answers], expected, atol=1e-6)


def test_a_saved_model_with_named_inputs_takes_objects_and_answers_by_name(tmp_path):
    tf = tensorflow()

    class Scaler(tf.Module):
        def __init__(self):
            self.w = tf.Variable([[1.0, -2.0], [0.5, 3.0]])

        @tf.function(input_signature=[tf.TensorSpec((None, 2), tf.float32, name="features"),
                                      tf.TensorSpec((None,), tf.string, name="tag")])
        def serve(self, features, tag):
            return {"score": tf.matmul(features, self.w), "length": tf.strings.length(tag)}

    module = Scaler()
    tf.saved_model.save(module, str(tmp_path), signatures={"serving_default": module.serve})
    served = loaded(tmp_path)
    assert served.ref.format == "savedmodel"
    assert [i["name"] for i in served.about()["inputs"]] == ["features", "tag"]
    answers = served.predict([{"features": [1, 2], "tag": "abc"},
                              {"features": [0, 1], "tag": {"b64": base64.b64encode(b"hello").decode()}}])
    assert answers == [{"length": 3, "score": [2.0, 4.0]}, {"length": 5, "score": [0.5, 3.0]}]
    # V2 tensors by name are the same instances
    from launcher.predict import protocols

    tensors = {"tag": np.asarray(["abc", "hello"], dtype=object), "features": np.asarray([[1, 2], [0, 1]], np.float32)}
    assert served.predict(protocols.instances(tensors, ["features", "tag"])) == answers
    with pytest.raises(ValueError, match=r"instances\[0\] has no tag \(the model's inputs: features, tag\)"):
        served.inputs([{"features": [1, 2]}])
    with pytest.raises(ValueError, match=r"each instance's features must have shape \[2\], got \[3\]"):
        served.inputs([{"features": [1, 2, 3], "tag": "x"}])
    with pytest.raises(ValueError, match=r"instances\[0\] must be an object with the inputs features, tag"):
        served.inputs([[1, 2]])


def test_a_keras_functions_model_keras_answers_as_the_model(tmp_path):
    tensorflow()
    from workloads.tf_models import keras

    k = keras()
    model = k.Sequential([k.layers.Input((3,), name="x"), k.layers.Dense(2, name="y")])
    model.save(str(tmp_path / "model.keras"))
    (tmp_path / "model.json").write_text(json.dumps({"workload": "fn.py:train", "framework": "tensorflow",
                                                     "kind": "training function", "files": {"model.keras": "k"}}))
    served = loaded(tmp_path)
    assert served.ref.format == "keras"
    x = np.asarray([[1, 2, 3], [0, -1, 0.5]], np.float32)
    np.testing.assert_allclose(served.predict(x.tolist()), model(x).numpy(), rtol=1e-5)
    # its one input by name, as Vertex's containers take it; another object is a line of the forms
    assert served.predict([{"x": row} for row in x.tolist()]) == served.predict(x.tolist())
    with pytest.raises(ValueError, match=r'instances\[0\] is an object with "y": send each instance as the value '
                                         r'of x, as \{"x": value\}, or bytes as \{"b64": \.\.\.\}'):
        served.inputs([{"y": [1, 2, 3]}])


def test_a_folder_nothing_can_load_and_a_torch_functions_weights_are_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match=r"no model in .*a model folder holds model.joblib/model.pkl \(scikit-learn\)"):
        locate(str(tmp_path))
    (tmp_path / "model.json").write_text(json.dumps({"workload": "f.py:train", "framework": "torch",
                                                     "kind": "training function", "files": {"state_dict.pt": "w"}}))
    with pytest.raises(UserError, match=r"a training function's model \(state_dict.pt\)"):
        locate(str(tmp_path))
    (tmp_path / "model.json").write_text(json.dumps({"workload": "no-such-workload", "framework": "torch",
                                                     "input_shape": [3], "num_classes": None}))
    with pytest.raises(UserError, match="the model's workload no-such-workload cannot be loaded"):
        locate(str(tmp_path))


def test_vertex_variables_set_the_routes_and_a_token_is_kept_as_its_hash(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    routes = replica.routes({"AIP_PREDICT_ROUTE": "/v1/endpoints/1/deployedModels/2:predict",
                           "AIP_HEALTH_ROUTE": "/ping", "AIP_DEPLOYED_MODEL_ID": "2"}, token_file=str(token))
    assert routes.kind("/v1/endpoints/1/deployedModels/2:predict") == "predict" and routes.kind("/ping") == "health"
    assert routes.kind("/predict") == "predict" and routes.kind("/healthz") == "health"
    assert routes.kind("/other") is None and routes.deployed_model_id == "2"
    assert routes.token_sha256 == hashlib.sha256(b"s3cret-token-0123456789").hexdigest()
    assert routes.authorised("Bearer s3cret-token-0123456789") and not routes.authorised("Bearer wrong")
    assert not routes.authorised(None) and not routes.authorised("s3cret-token-0123456789")
    assert routes.max_body == 1_572_864  # Vertex AI's 1.5 MB
    for env, message in (({"AIP_PREDICT_ROUTE": "predict"}, "a route is a path starting with /"),):
        with pytest.raises(UserError, match=message):
            replica.routes(env)
    with pytest.raises(UserError, match=r"--max-body-mb 0: must be more than 0"):
        replica.routes({}, max_body_mb=0)
    assert replica.routes({}, max_body_mb=4).max_body == 4 << 20
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(UserError, match="16 or more characters"):
        replica.routes({}, token_file=str(tmp_path / "short"))
    with pytest.raises(UserError, match="cannot read it"):
        replica.routes({}, token_file=str(tmp_path / "missing"))


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    """A real Starlette request, as Ray Serve's proxy hands a replica one."""
    from starlette.requests import Request

    sent = {"done": False}

    async def receive():
        if sent["done"]:
            return {"type": "http.disconnect"}
        sent["done"] = True
        return {"type": "http.request", "body": body, "more_body": False}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw.append((b"content-length", str(len(body)).encode()))
    return Request({"type": "http", "method": method, "path": path, "headers": raw, "query_string": b""}, receive)


def test_the_endpoint_answers_vertex_bodies_with_its_token_and_refuses_the_rest(tmp_path, digits):
    x, y = digits
    model = LogisticRegression(max_iter=300).fit(x[:500], y[:500])
    joblib.dump(model, tmp_path / "model.joblib")
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-1234")
    routes = replica.routes({"AIP_PREDICT_ROUTE": "/v1/p", "AIP_HEALTH_ROUTE": "/h"}, token_file=str(token),
                          name="digits_sk")
    endpoint = replica.Endpoint(locate(str(tmp_path)), routes)

    async def direct(batch):  # what @serve.batch does with one request
        return (await endpoint._batch_impl([batch]))[0]

    endpoint._batch = direct
    auth = {"Authorization": "Bearer a-token-long-enough-1234"}

    def call(method, path, body=None, headers=auth):
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        response, _ = asyncio.run(endpoint.answer(request(method, path, data, headers)))
        return response.status_code, json.loads(response.body)

    code, answer = call("POST", "/v1/p", {"instances": x[500:510].tolist(), "parameters": {}})
    assert code == 200 and answer["predictions"] == model.predict(x[500:510]).tolist()
    assert answer["deployedModelId"] == "digits_sk"
    assert call("POST", "/v1/p", {"instances": x[:1].tolist()}, {"Authorization": "Bearer nope"})[0] == 401
    assert call("POST", "/predict", {"instances": x[:1].tolist()}, {})[0] == 401
    assert call("GET", "/h", headers={}) == (200, {"status": "ok"})  # open to health checks, no details
    assert call("GET", "/h")[1]["format"] == "sklearn"
    code, answer = call("POST", "/predict", {"instances": x[:1].tolist(), "parameters": [1]})
    assert code == 400 and answer["error"] == "parameters must be an object, got list"
    code, answer = call("POST", "/predict", b"[" + b"0," * 1_000_000 + b"0]")
    assert code == 413 and "1572864 bytes" in answer["error"]


def test_the_v2_protocol_takes_json_and_binary_tensors_and_describes_the_model(tmp_path, digits):
    x, y = digits
    model = LogisticRegression(max_iter=300).fit(x[:500], y[:500])
    joblib.dump(model, tmp_path / "model.joblib")
    endpoint = replica.Endpoint(locate(str(tmp_path)), replica.routes({}, name="digits_sk"))

    async def direct(batch):
        return (await endpoint._batch_impl([batch]))[0]

    endpoint._batch = direct

    def call(method, path, body=b"", headers=None):
        response, _ = asyncio.run(endpoint.answer(request(method, path, body, headers)))
        return response.status_code, json.loads(response.body)

    rows = x[500:508].astype(np.float32)
    tensor = {"name": "x", "shape": [8, 64], "datatype": "FP32"}
    code, answer = call("POST", "/v2/models/digits_sk/infer",
                        json.dumps({"id": "r1", "inputs": [{**tensor, "data": rows.reshape(-1).tolist()}]}).encode())
    assert code == 200 and answer["id"] == "r1" and answer["model_name"] == "digits_sk"
    assert answer["outputs"] == [{"name": "prediction", "shape": [8], "datatype": "INT64",
                                  "data": model.predict(rows).tolist()}]
    # the binary tensor extension: the JSON header, then the raw little-endian floats
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": rows.nbytes}}]}).encode()
    code, binary = call("POST", "/v2/models/digits_sk/versions/1/infer", head + rows.astype("<f4").tobytes(),
                        {"Inference-Header-Content-Length": str(len(head))})
    assert code == 200 and binary["outputs"] == answer["outputs"]
    assert call("GET", "/v2/health/ready") == (200, {"ready": True})
    assert call("GET", "/v2/health/live") == (200, {"live": True})
    assert call("GET", "/v2")[1]["extensions"] == ["binary_tensor_data"]
    meta = call("GET", "/v2/models/digits_sk")[1]
    assert meta["inputs"] == [{"name": "x", "shape": [-1, 64], "datatype": "FP32"}] and meta["platform"] == "sklearn"
    assert call("GET", "/v2/models/other")[0] == 404
    for bad, message in (({"inputs": []}, "inputs must be a non-empty list"),
                         ({"inputs": [{**tensor, "data": [0.0] * 10}]}, "holds 10 values; its shape [8, 64] needs 512"),
                         ({"inputs": [{**tensor, "datatype": "FP99", "data": []}]}, "datatype 'FP99' is not one of"),
                         ({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
                          "each instance must be 64 numbers")):
        code, answer = call("POST", "/v2/models/digits_sk/infer", json.dumps(bad).encode())
        assert code == 400 and message in answer["error"], answer


TAGGER = """
import numpy as np


def train(session):
    pass


def predict(model, instances, parameters):
    # words in: ids by letter, a fixed extra; the highest logit's name out, scaled as asked
    ids = np.asarray([[ord(c) % 11 for c in word.ljust(5)[:5]] for word in instances])
    out = model(ids, extra=np.zeros((len(instances), 3), np.float32))
    scale = parameters.get("scale", 1)
    return [{"label": ["no", "yes"][int(row.argmax())], "score": float(row.max()) * scale}
            for row in out["logits"]]
"""


def test_a_training_functions_model_is_exported_from_its_first_inputs_and_served_by_name(tmp_path):
    import torch

    from launcher.storage import Storage
    from launcher.worker.export import example_rows, export_weights, torch_program

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(11, 4), torch.nn.Linear(4 + 3, 2)

        def forward(self, ids, extra):
            return {"logits": self.head(torch.cat([self.embed(ids).mean(1), extra], 1)), "length": (ids > 0).sum(1)}

    (tmp_path / "tagger.py").write_text(TAGGER)

    class Spec:  # what a training function's export reads of its spec
        workload, framework, params, name, data = f"{tmp_path}/tagger.py:train", "torch", {}, "tagger", None

    model = TwoInputs()
    seen = {}
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.setdefault("x", example_rows(a, k)), with_kwargs=True)
    model(torch.randint(0, 11, (8, 5)), extra=torch.randn(8, 3))  # the first batch: 8 rows
    hook.remove()
    assert seen["x"][0][0].shape == (2, 5) and seen["x"][1]["extra"].shape == (2, 3)
    program, why = torch_program(model, seen["x"])
    assert why is None and [i["name"] for i in program["inputs"]] == ["ids", "extra"]
    assert program["inputs"][0]["shape"] == [-1, -1]  # a sequence of any length: the model allows it
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    torch.save(model.state_dict(), checkpoint / "model.pt")
    export_weights(Spec, str(checkpoint), Storage.resolve(str(tmp_path / "runs")), program)
    served = loaded(tmp_path / "runs" / "tagger")
    assert served.ref.format == "program" and served.ref.info["predict"] == f"{tmp_path}/tagger.py:predict"

    # the program alone, by its inputs' names, for another batch size and length than the example's
    ids, extra = torch.randint(0, 11, (5, 7)), torch.randn(5, 3)
    answers = served.answers(served.run(served.inputs([{"ids": i, "extra": e}
                                                       for i, e in zip(ids.tolist(), extra.tolist())])))
    expected = model.eval()(ids, extra)
    np.testing.assert_allclose([a["logits"] for a in answers], expected["logits"].detach().numpy(), rtol=1e-5)
    assert [a["length"] for a in answers] == expected["length"].tolist()
    with pytest.raises(ValueError, match=r"each instance's extra must have shape \[3\], got \[4\]"):
        served.inputs([{"ids": [1, 2, 3, 4], "extra": [0, 0, 0, 0]}])

    # through the file's predict hook: words in, labels out, as the model called by hand gives
    words = ["apple", "kiwi", "fig"]
    with torch.no_grad():
        logits = model(torch.tensor([[ord(c) % 11 for c in w.ljust(5)[:5]] for w in words]), torch.zeros(3, 3))["logits"]
    got = served.predict(words, {"scale": 2})
    assert [g["label"] for g in got] == [["no", "yes"][int(i)] for i in logits.argmax(1)]
    np.testing.assert_allclose([g["score"] for g in got], (logits.max(1).values * 2).numpy(), rtol=1e-5)

    # and so does the server, on a real Starlette request: Vertex AI's body and the V2 protocol
    endpoint = replica.Endpoint(served.ref, replica.routes({}, name="tagger"))
    response, _ = asyncio.run(endpoint.answer(request("POST", "/predict", json.dumps(
        {"instances": words, "parameters": {"scale": 2}}).encode())))
    assert response.status_code == 200 and json.loads(response.body)["predictions"] == got
    v2 = {"inputs": [{"name": "words", "shape": [3], "datatype": "BYTES", "data": words}], "parameters": {"scale": 2}}
    response, _ = asyncio.run(endpoint.answer(request("POST", "/v2/models/tagger/infer", json.dumps(v2).encode())))
    assert json.loads(response.body) == {"model_name": "tagger", "outputs": [
        {"name": "prediction", "shape": [3], "datatype": "BYTES", "data": got}]}
    response, _ = asyncio.run(endpoint.answer(request("POST", "/predict", b'{"instances": [3]}')))
    assert response.status_code == 500 and "the model's predict hook failed: AttributeError" in \
        json.loads(response.body)["error"]

    # a forward taking something other than tensors keeps its weights only, and says why
    assert torch_program(model, ((torch.zeros(2, 5, dtype=torch.long), "text"), {}))[1] == \
        "its forward takes Tensor, str, and predict and serve send it tensors of a batch"


def test_serve_flags_and_aip_variables_that_cannot_work_are_one_line_before_ray(tmp_path, capsys, monkeypatch):
    from launcher.cli.main import main

    joblib.dump(LinearRegression().fit([[0.0], [1.0]], [0.0, 1.0]), tmp_path / "model.joblib")
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AIP_HTTP_PORT", "eighty")
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "AIP_HTTP_PORT='eighty' is not a port number" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.delenv("AIP_HTTP_PORT")
    monkeypatch.setenv("AIP_STORAGE_URI", str(tmp_path))  # the model, with neither --model nor --run
    assert main(["serve", "--token-file", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "--token-file" in err and "cannot read it" in err and len(err.strip().splitlines()) == 1, err
    assert main(["serve", "--max-body-mb", "-1"]) == 2
    assert "--max-body-mb -1: must be more than 0" in capsys.readouterr().err


def test_vertex_instances_by_the_inputs_name_are_taken_and_a_400_lists_the_forms(tmp_path, digits):
    """Issue 65 item 5: {"instances": [{"x": [...]}]} (the input as the V2 metadata names it) was a 400
    ('instances[0] is an object, not a number'). Vertex's prebuilt containers take named inputs: a
    run's model takes its one input by name, a booster fitted on a table its features by name too,
    and an object that is neither is a 400 listing what the server takes."""
    import pandas as pd
    import torch
    import xgboost as xgb

    import workloads

    x, y = digits
    # A run's export of the default workload (digits-mlp, what `launcher run` trains)
    workload = workloads.get("digits-mlp")
    shape = workload.input_shape({})
    program = torch.export.export(workload.torch_model({}).eval(), (torch.zeros(2, *shape),),
                                  dynamic_shapes=({0: torch.export.Dim.AUTO},))
    run_model = tmp_path / "run" / "model"
    run_model.mkdir(parents=True)
    torch.export.save(program, str(run_model / "model.pt2"))
    (run_model / "model.json").write_text(json.dumps({"workload": "digits-mlp", "framework": "torch",
                                                      "input_shape": list(shape), "num_classes": 10, "params": {}}))
    endpoint = replica.Endpoint(locate(str(tmp_path / "run")), replica.routes({}, name="digits"))

    async def direct(batch):
        return (await endpoint._batch_impl([batch]))[0]

    endpoint._batch = direct

    def call(body):
        response, _ = asyncio.run(endpoint.answer(request("POST", "/predict", json.dumps(body).encode())))
        return response.status_code, json.loads(response.body)

    meta, _ = asyncio.run(endpoint.answer(request("GET", "/v2/models/digits")))
    assert [i["name"] for i in json.loads(meta.body)["inputs"]] == [INPUT] == ["x"]
    code, plain = call({"instances": x[:3].tolist()})
    assert code == 200, plain
    code, named = call({"instances": [{"x": row} for row in x[:3].tolist()]})
    assert (code, named["predictions"]) == (200, plain["predictions"]), named
    code, answer = call({"instances": [{"pixels": x[0].tolist()}]})
    assert code == 400 and answer["error"].startswith(
        'instances[0] is an object with "pixels": send each instance as its numbers ([...]), or as {"x": [...]}'), answer

    # A booster fitted on a table: its features by name (in any order), or the row, or {"x": row}
    names = [f"f{i}" for i in range(64)]
    booster = xgb.train({"objective": "reg:squarederror", "max_depth": 2},
                        xgb.DMatrix(pd.DataFrame(x, columns=names), label=y), 5)
    (tmp_path / "bst").mkdir()
    (tmp_path / "bst" / "model.bst").write_bytes(bytes(booster.save_raw("ubj")))
    served = loaded(tmp_path / "bst")
    expected = served.predict(x[:2].tolist())
    assert served.predict([dict(reversed(list(zip(names, row)))) for row in x[:2].tolist()]) == expected
    assert served.predict([{"x": row} for row in x[:2].tolist()]) == expected
    with pytest.raises(ValueError, match=r'instances\[0\] is an object with "f0": send each instance as its numbers '
                                         r'\(\[\.\.\.\]\), or as \{"x": \[\.\.\.\]\} or \{"f0": \.\.\., "f1": \.\.\., '
                                         r'"f2": \.\.\., \.\.\.\} by its 64 features\' names'):
        served.inputs([{"f0": 1.0}])

    # scikit-learn: {"x": row} too
    joblib.dump(LogisticRegression(max_iter=300).fit(x[:500], y[:500]), tmp_path / "model.joblib")
    served = loaded(tmp_path)
    assert served.predict([{"x": row} for row in x[500:503].tolist()]) == served.predict(x[500:503].tolist())
