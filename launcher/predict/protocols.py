"""The Open Inference Protocol (KServe V2) beside Vertex AI's ``{"instances": [...]}``.

Routes (``NAME`` is the served model's name, ``/healthz`` says it)::

    POST /v2/models/NAME/infer          (also /v2/models/NAME/versions/V/infer)
    GET  /v2/models/NAME                the model's inputs and outputs
    GET  /v2/models/NAME/ready
    GET  /v2/health/live, /v2/health/ready, /v2

A request names its input tensors: ``{"inputs": [{"name", "shape", "datatype", "data"}]}``
with ``data`` flat (row-major) or nested. A tensor's data may instead follow the JSON as raw
little-endian bytes (the binary tensor extension): the JSON's length is in the
``Inference-Header-Content-Length`` header and the tensor says ``"parameters":
{"binary_data_size": BYTES}``, which skips JSON number parsing for large requests. The
answer holds one tensor per output column (a classifier: ``prediction`` and ``scores``) as JSON.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

HEADER_LENGTH = "inference-header-content-length"
V2_PATH = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<what>/infer|/ready)?$")
DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64, "BYTES": object}


class ProtocolError(ValueError):
    """A request the protocol cannot take; str() names the field."""


def route(path: str) -> tuple[str, str | None] | None:
    """(what, the model name in the path) for a V2 path, else None. ``what``: infer, model,
    model_ready, live, ready, server."""
    fixed = {"/v2": "server", "/v2/health/live": "live", "/v2/health/ready": "ready"}
    if path in fixed:
        return fixed[path], None
    match = V2_PATH.match(path)
    if not match:
        return None
    what = {"/infer": "infer", "/ready": "model_ready", None: "model"}[match["what"]]
    return what, match["name"]


def datatype(array: np.ndarray) -> str:
    if array.dtype.kind in "OUS":
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype is not object and array.dtype == np.dtype(dtype):
            return name
    return "FP64"


def parse(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the request's JSON, its input tensors by name, each shaped as it says)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise ProtocolError(f"Inference-Header-Content-Length {header_length!r} is not a length within the body")
        split = int(header_length)
        head, binary = body[:split], memoryview(body)[split:]
    else:
        head, binary = body, memoryview(b"")
    try:
        request = orjson.loads(head)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("the request is not JSON: send {\"inputs\": [{\"name\", \"shape\", \"datatype\", "
                            "\"data\"}]}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise ProtocolError("inputs must be a non-empty list of tensors {\"name\", \"shape\", \"datatype\", \"data\"}")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(request["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise ProtocolError(f"{where} must be an object")
        name, shape, kind = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{where}.name must be a string")
        if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"{where}.shape must be a list of sizes, the first the batch")
        if kind not in DATATYPES:
            raise ProtocolError(f"{where}.datatype {kind!r} is not one of {', '.join(DATATYPES)}")
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if kind == "BYTES" or not isinstance(size, int) or offset + size > len(binary):
                raise ProtocolError(f"{where}.parameters.binary_data_size {size!r} does not fit the body's "
                                    "binary part (and BYTES tensors go as JSON)")
            array = np.frombuffer(binary[offset:offset + size], dtype=np.dtype(DATATYPES[kind]).newbyteorder("<"))
            offset += size
        else:
            if "data" not in tensor:
                raise ProtocolError(f"{where} has no data (nor parameters.binary_data_size)")
            try:
                array = np.asarray(tensor["data"], dtype=DATATYPES[kind])
            except (ValueError, TypeError):
                raise ProtocolError(f"{where}.data must be {kind} values") from None
        count = int(np.prod(shape))
        if array.size != count:
            raise ProtocolError(f"{where} holds {array.size} values; its shape {shape} needs {count}")
        tensors[name] = array.reshape(shape)
    batch = {len(a) for a in tensors.values()}
    if len(batch) != 1:
        raise ProtocolError("the input tensors' first dimensions (the batch) differ")
    return request, tensors


def instances(tensors: dict[str, np.ndarray], input_names: list[str] | None) -> Any:
    """The tensors as the model's instances: one input's array as it is, several as one object
    per row (the names a model with several inputs declares)."""
    if len(tensors) == 1 and (not input_names or len(input_names) == 1):
        return next(iter(tensors.values()))
    missing = [n for n in input_names or [] if n not in tensors]
    if missing and input_names:
        raise ProtocolError(f"no input tensor named {missing[0]} (the model's inputs: {', '.join(input_names)})")
    rows = len(next(iter(tensors.values())))
    return [{n: _row(tensors[n][i]) for n in tensors} for i in range(rows)]


def _row(value: np.ndarray) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def response(name: str, request: dict[str, Any], columns: dict[str, np.ndarray]) -> dict[str, Any]:
    """The V2 answer: one output tensor per column, data flat in row-major order."""
    outputs = []
    for column, array in columns.items():
        array = np.asarray(array)
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        outputs.append({"name": column, "shape": list(array.shape), "datatype": datatype(array), "data": data})
    answer: dict[str, Any] = {"model_name": name, "outputs": outputs}
    if "id" in request:
        answer["id"] = request["id"]
    return answer


def metadata(name: str, about: dict[str, Any]) -> dict[str, Any]:
    """``GET /v2/models/NAME``: the model's inputs as /healthz describes them."""
    inputs = about.get("inputs")
    if inputs is None:
        shape = about.get("input_shape")
        width = about.get("features")
        dims = [-1, *shape] if shape else [-1, width if width else -1]
        inputs = [{"name": "x", "shape": dims, "datatype": "FP32"}]
    else:
        inputs = [{"name": i["name"], "shape": [-1, *i["shape"]], "datatype": _v2_type(i["dtype"])} for i in inputs]
    return {"name": name, "versions": ["1"], "platform": about.get("format", ""), "inputs": inputs}


def _v2_type(dtype: str) -> str:
    try:
        return datatype(np.empty(0, dtype=dtype))
    except TypeError:
        return "BYTES"
