"""Shard sets (launcher/data: index, formats, writer) and ``launcher data shard`` / ``launcher data index``.

The fast tests write small inputs (PNGs made with pillow, numpy arrays, CSV,
parquet and jsonl files), shard them through the CLI, and read every sample
back through the index, in order; each refusal is one stderr line and exit 2.
The integration test writes and reads a set on the Cloud Storage emulator.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from PIL import Image

from launcher.cli.main import main
from launcher.data import writer
from launcher.data.formats import count_samples, read_shard, sha256_of, verify, write_shard
from launcher.data.index import FORMAT, INDEX, ShardError, ShardIndex, ShardInfo
from launcher.errors import Unreachable, UserError
from launcher.lab.gcs_emulator import free_port
from launcher.storage import Storage
from test_cli import assert_one_line_error, run_cli


def read_set(uri: str, copies: str | None = None) -> tuple[ShardIndex, list]:
    """Every sample of a set, in order, each shard checked against the index first (gs:// ones
    through a copy in the local folder ``copies``)."""
    index = ShardIndex.load(uri)
    storage = Storage.resolve(index.uri)
    samples = []
    for info in index.shards:
        path = storage.path(info.name)
        if not storage.is_local:
            path = os.path.join(copies, info.name)
            with storage.fs.open_input_stream(storage.path(info.name)) as src, open(path, "wb") as dst:
                dst.write(src.read())
        verify(path, info, index.uri)
        samples += read_shard(index.kind, path, index.fields)
    assert len(samples) == index.samples
    return index, samples


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((6, 6, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def image_folder(root, classes=("cat", "dog", "eel"), per_class=4) -> list[tuple[bytes, int]]:
    """ROOT/CLASS/NNN.png files; returns (bytes, class number) in the order the writer takes them."""
    expected = []
    for number, name in enumerate(classes):
        os.makedirs(root / name)
        for i in range(per_class):
            data = png(number * 40 + i)
            (root / name / f"{i:03d}.png").write_bytes(data)
            expected.append((data, number))
    return expected


# -- round trips --------------------------------------------------------------------------------

def test_an_image_folder_becomes_tar_shards_read_back_in_order(capsys, tmp_path):
    expected = image_folder(tmp_path / "images")
    (tmp_path / "images" / "cat" / ".DS_Store").write_bytes(b"hidden files are left out")
    out = tmp_path / "set"
    code, stdout, stderr = run_cli(capsys, "data", "shard", str(tmp_path / "images"), str(out),
                                   "--samples-per-shard", "5")
    assert code == 0, stderr
    assert stdout.strip().startswith("3 tar shards, 12 samples, ") and stdout.strip().endswith(
        f": {out} (give this to the training code)")
    assert stderr.splitlines()[0].startswith("shard 1/3: 5 samples, ")
    index, samples = read_set(str(out))
    assert index.fields == {"classes": ["cat", "dog", "eel"]}
    assert [s.samples for s in index.shards] == [5, 5, 2]
    # Written in an order drawn from seed 0: each shard holds several classes, not one.
    shuffled = [expected[i] for i in np.random.default_rng(0).permutation(len(expected))]
    assert [(s["png"], int(s["cls"])) for s in samples] == shuffled
    assert all(len({int(s["cls"]) for s in samples[k:k + 5]}) > 1 for k in (0, 5))
    assert [s["__key__"] for s in samples] == [f"{n:08d}" for n in range(12)]
    assert sorted(os.listdir(out)) == [INDEX, "shard-00000.tar", "shard-00001.tar", "shard-00002.tar"]
    kept = tmp_path / "kept"
    assert run_cli(capsys, "data", "shard", str(tmp_path / "images"), str(kept), "--keep-order")[0] == 0
    assert [(s["png"], int(s["cls"])) for s in read_set(str(kept))[1]] == expected


def test_npz_arrays_come_back_with_their_shape_and_dtype(capsys, tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"image": rng.random((50, 8, 8), dtype=np.float32), "label": np.arange(50, dtype=np.int64),
              "rgb": rng.integers(0, 255, (50, 3), dtype=np.uint8),
              "big_endian": np.arange(50 * 2, dtype=">i4").reshape(50, 2)}
    np.savez(tmp_path / "digits.npz", **arrays)
    argv = ["data", "shard", str(tmp_path / "digits.npz"), str(tmp_path / "set"), "--samples-per-shard", "16"]
    assert main(argv) == 0
    index, samples = read_set(str(tmp_path / "set"))
    assert index.kind == "parquet" and [s.samples for s in index.shards] == [16, 16, 16, 2]
    assert index.fields["image"] == {"shape": [8, 8], "dtype": "float32"}
    assert index.fields["big_endian"] == {"shape": [2], "dtype": "int32"}
    for name, array in arrays.items():
        back = np.stack([s[name] for s in samples])
        assert back.dtype == array.dtype.newbyteorder("=") and back.shape == array.shape
        np.testing.assert_array_equal(back, array)
    assert samples[3]["image"].flags.writeable  # torch.from_numpy warns on read-only arrays


def test_tables_become_parquet_or_jsonl_shards(tmp_path):
    rows = [{"id": i, "name": f"row {i}", "score": i / 4} for i in range(40)]
    table = pa.Table.from_pylist(rows)
    pyarrow.csv.write_csv(table, tmp_path / "t.csv")
    pq.write_table(table, tmp_path / "t.parquet")
    for source, kind in (("t.csv", None), ("t.parquet", None), ("t.csv", "jsonl")):
        out = str(tmp_path / f"{source}-{kind}")
        made = writer.shard(str(tmp_path / source), out, kind=kind, samples_per_shard=15)
        index, samples = read_set(out)
        assert index == made and index.kind == (kind or "parquet")
        assert [s.samples for s in index.shards] == [15, 15, 10] and samples == rows


def test_jsonl_becomes_jsonl_or_parquet_shards(tmp_path):
    rows = [{"text": "é" * i, "n": i, "tags": ["a", "b"][: i % 3]} for i in range(30)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 5 else "")
                                               for i, r in enumerate(rows)), encoding="utf-8")
    for kind in ("jsonl", "parquet"):
        writer.shard(str(tmp_path / "in.jsonl"), str(tmp_path / kind), kind=kind, samples_per_shard=7)
        index, samples = read_set(str(tmp_path / kind))
        assert index.kind == kind and len(index.shards) == 5 and samples == rows


def test_tfrecord_shards_round_trip_and_are_indexed(tmp_path):
    records = [{"record": f"example {i}".encode() * (i + 1)} for i in range(9)]
    (tmp_path / "tf").mkdir()
    write_shard("tfrecord", records[:4], str(tmp_path / "tf" / "a.tfrecord"))
    write_shard("tfrecord", records[4:], str(tmp_path / "tf" / "b.tfrecord"))
    made = writer.index(str(tmp_path / "tf"))
    assert made.kind == "tfrecord" and [s.samples for s in made.shards] == [4, 5]
    assert read_set(str(tmp_path / "tf"))[1] == records
    damaged = bytearray((tmp_path / "tf" / "b.tfrecord").read_bytes())
    damaged[20] ^= 0xFF  # inside the first record: its checksum no longer matches
    (tmp_path / "tf" / "b.tfrecord").write_bytes(bytes(damaged))
    with pytest.raises(ShardError, match="b.tfrecord: not a readable tfrecord shard"):
        read_shard("tfrecord", str(tmp_path / "tf" / "b.tfrecord"))


def test_write_shard_and_read_shard_are_inverses(tmp_path):
    cases = {
        "jsonl": [{"a": 1, "b": [1, 2]}, {"a": 2, "b": []}],
        "tar": [{"__key__": "x/001", "jpg": b"\xff\xd8", "cls": b"3"}, {"__key__": "x/002", "txt": b"hi"}],
        "parquet": [{"v": np.ones((2, 3), np.float16), "n": 1}, {"v": np.zeros((2, 3), np.float16), "n": 2}],
    }
    fields = {"v": {"shape": [2, 3], "dtype": "float16"}}
    for kind, samples in cases.items():
        path = str(tmp_path / f"one.{kind}")
        write_shard(kind, samples, path, fields)
        back = read_shard(kind, path, fields)
        assert len(back) == len(samples) and count_samples(kind, path) == len(samples)
        for got, want in zip(back, samples):
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


# -- cutting ------------------------------------------------------------------------------------

def test_shards_are_cut_by_size(tmp_path):
    arrays = {"x": np.zeros((200, 256), np.float32)}  # 1 KiB a sample
    np.savez(tmp_path / "x.npz", **arrays)
    notes: list[str] = []
    made = writer.shard(str(tmp_path / "x.npz"), str(tmp_path / "set"), shard_mb=30 / 1024, note=notes.append)
    assert [s.samples for s in made.shards] == [30] * 6 + [20]  # 30 KiB of samples each, the rest last
    assert notes[0].startswith("shard 1/~7: 30 samples, ") and len(notes) == 7

    expected = image_folder(tmp_path / "images", per_class=6)
    made = writer.shard(str(tmp_path / "images"), str(tmp_path / "tars"), shard_mb=4 / 1024, shuffle_seed=None)
    sizes = [s.bytes for s in made.shards]
    assert len(sizes) > 2 and max(sizes) <= 4 * 1024 + 10240  # within the limit, plus the tar's end padding
    assert [(s["png"], int(s["cls"])) for s in read_set(str(tmp_path / "tars"))[1]] == expected


def test_one_sample_larger_than_a_shard_makes_a_shard_alone(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"t": "x" * n}) + "\n" for n in (10, 5000, 10, 10)))
    made = writer.shard(str(tmp_path / "in.jsonl"), str(tmp_path / "set"), shard_mb=1 / 1024)
    assert [s.samples for s in made.shards] == [1, 1, 2]


# -- the index ----------------------------------------------------------------------------------

def test_offsets_and_shard_of(tmp_path):
    shards = tuple(ShardInfo(f"s{i}", n, 1, "0" * 64) for i, n in enumerate((3, 0, 2, 5)))
    index = ShardIndex(str(tmp_path), "jsonl", shards, {})
    assert index.samples == 10 and index.offsets().tolist() == [0, 3, 3, 5, 10]
    assert [index.shard_of(i) for i in (0, 2, 3, 4, 5, 9)] == [(0, 0), (0, 2), (2, 0), (2, 1), (3, 0), (3, 4)]
    with pytest.raises(IndexError):
        index.shard_of(10)
    assert ShardIndex.from_json(index.to_json(), index.uri) == index
    assert json.loads(index.to_json())["format"] == FORMAT


def test_index_on_shards_written_by_hand(capsys, tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    members = [("a/0001.jpg", b"one"), ("a/0001.cls", b"1"), ("a/0002.jpg", b"two"), ("a/0002.cls", b"0"),
               ("b.x/0003.seg.png", b"three")]
    with tarfile.open(folder / "part-0.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(folder / "part-1.tar", "w") as tar:
        info = tarfile.TarInfo("c/0004.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"four"))
    (folder / "README.md").write_text("not a shard: left out")
    code, out, err = run_cli(capsys, "data", "index", str(folder))
    assert code == 0, err
    assert out.startswith("indexed 2 tar shards, 4 samples, ") and out.strip().endswith(str(folder))
    index, samples = read_set(str(folder))
    assert [s.name for s in index.shards] == ["part-0.tar", "part-1.tar"]
    assert samples == [{"__key__": "a/0001", "jpg": b"one", "cls": b"1"},
                       {"__key__": "a/0002", "jpg": b"two", "cls": b"0"},
                       {"__key__": "b.x/0003", "seg.png": b"three"},
                       {"__key__": "c/0004", "txt": b"four"}]
    assert index.shards[0].sha256 == sha256_of(str(folder / "part-0.tar"))

    pq_folder = tmp_path / "pq"
    pq_folder.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"x": list(range(i * 10, i * 10 + 10))}), pq_folder / f"{i}.parquet")
    made = writer.index(str(pq_folder))
    assert made.kind == "parquet" and made.samples == 30
    assert [s["x"] for s in read_set(str(pq_folder))[1]] == list(range(30))


def test_reindexing_keeps_the_fields(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones((6, 2), np.float32))
    writer.shard(str(tmp_path / "a.npz"), str(tmp_path / "set"), samples_per_shard=2)
    os.remove(tmp_path / "set" / "shard-00002.parquet")  # a shard dropped on purpose
    made = writer.index(str(tmp_path / "set"), overwrite=True)
    assert made.samples == 4 and made.fields == {"x": {"shape": [2], "dtype": "float32"}}
    assert read_set(str(tmp_path / "set"))[1][0]["x"].tolist() == [1.0, 1.0]


# -- damaged and missing shards -----------------------------------------------------------------

def test_a_damaged_or_missing_shard_is_one_line_naming_it(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.arange(40, dtype=np.float64).reshape(20, 2))
    index = writer.shard(str(tmp_path / "a.npz"), str(tmp_path / "set"), samples_per_shard=5)
    info = index.shards[3]
    path = tmp_path / "set" / info.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError) as caught:
        verify(str(path), info, index.uri)
    assert str(caught.value).startswith(f"shard-00003.parquet of {index.uri}: its sha256 differs")
    assert "launcher data shard" in str(caught.value) and "\n" not in str(caught.value)

    path.write_bytes(bytes(data[:100]))  # cut off
    with pytest.raises(ShardError, match="shard-00003.parquet of .*: 100 bytes where the index says"):
        verify(str(path), info, index.uri)
    with pytest.raises(ShardError, match=f"{path}: not a readable parquet shard"):
        read_shard("parquet", str(path), index.fields)
    path.unlink()
    with pytest.raises(ShardError, match=f"shard-00003.parquet of {index.uri}: no copy at {path}"):
        verify(str(path), info, index.uri)
    with pytest.raises(ShardError, match=f"{path}: no such file"):
        read_shard("parquet", str(path))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ShardError, match="bad.jsonl: line 2 is not a JSON object"):
        read_shard("jsonl", str(bad))
    (tmp_path / "bad.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ShardError, match="bad.tar: not a readable tar shard"):
        read_shard("tar", str(tmp_path / "bad.tar"))


def test_a_shard_error_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ShardError("shard-00001.tar", "gs://b/ds", "no copy")))
    assert isinstance(error, UserError) and str(error).startswith("shard-00001.tar of gs://b/ds: no copy; ")


# -- refusals -----------------------------------------------------------------------------------

def bad_index(folder, text: str) -> str:
    os.makedirs(folder, exist_ok=True)
    (folder / INDEX).write_text(text)
    return str(folder)


GOOD = {"name": "s.jsonl", "samples": 1, "bytes": 3, "sha256": "a" * 64}


@pytest.mark.parametrize("body,needle", [
    (None, "has no index.json: not a shard set; make one with `launcher data "
           "shard INPUT"),
    ("{not json", "index.json is not JSON (Expecting property name enclosed in double quotes at line 1)"),
    ({"format": "other/2", "kind": "jsonl", "samples": 1, "shards": [GOOD]}, "format 'other/2', expected"),
    ({"format": FORMAT, "kind": "csv", "samples": 1, "shards": [GOOD]},
     "unknown kind 'csv' (valid: parquet, jsonl, tar, tfrecord)"),
    ({"format": FORMAT, "kind": "jsonl", "samples": 1, "shards": [{"name": "s.jsonl", "samples": 1}]},
     "shard entry 0 lacks bytes, sha256"),
    ({"format": FORMAT, "kind": "jsonl", "samples": -1, "shards": [{**GOOD, "samples": -1}]},
     "shard s.jsonl: samples is -1, not a whole number >= 0"),
    ({"format": FORMAT, "kind": "jsonl", "samples": 2, "shards": [GOOD, GOOD]}, "the shard s.jsonl is listed twice"),
    ({"format": FORMAT, "kind": "jsonl", "samples": 5, "shards": [GOOD]}, "'samples' is 5, its shards hold 1"),
    ({"format": FORMAT, "kind": "jsonl", "samples": 1, "shards": [{**GOOD, "name": "../x"}]},
     "not a path inside the set"),
    ({"format": FORMAT, "kind": "parquet", "samples": 1, "shards": [GOOD],
      "fields": {"x": {"shape": [2], "dtype": "nonsense"}}}, "field x: dtype 'nonsense' is not a numpy dtype"),
])
def test_a_bad_index_is_one_line(capsys, tmp_path, body, needle):
    folder = tmp_path / "set"
    if body is not None:
        bad_index(folder, body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(UserError) as caught:
        ShardIndex.load(str(folder))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    if body is None:  # and the CLI: reindexing an empty folder says there is nothing to index
        folder.mkdir()
        assert_one_line_error(*run_cli(capsys, "data", "index", str(folder))[::2], "holds no shard files")


def refusals(tmp):
    """(argv, what the one line says) for each input `launcher data shard` refuses."""
    (tmp / "flat").mkdir()
    (tmp / "flat" / "a.png").write_bytes(png(1))
    (tmp / "shards").mkdir()
    (tmp / "shards" / "shard-0.tar").write_bytes(b"")
    (tmp / "empty").mkdir()
    (tmp / "noclass" / "cat").mkdir(parents=True)
    (tmp / "e.jsonl").write_text("\n\n")
    (tmp / "j.jsonl").write_text('{"a": 1}\n')
    (tmp / "x.xlsx").write_bytes(b"?")
    np.savez(tmp / "uneven.npz", x=np.zeros((5, 2)), y=np.zeros(4))
    np.savez(tmp / "nothing.npz", x=np.zeros((0, 2)))
    pyarrow.csv.write_csv(pa.table({"a": pa.array([], pa.int64())}), tmp / "empty.csv")
    image_folder(tmp / "ok", classes=("a",), per_class=1)
    out = str(tmp / "out")
    return [
        (["missing", out], "INPUT {tmp}/missing does not exist"),
        (["x.xlsx", out], "not a kind of input `launcher data shard` reads"),
        (["gs://b-1/in", out], "is not a local path"),
        (["flat", out], "has files at its top level (a.png), not only class folders; put each file in the folder"),
        (["shards", out], "run `launcher data index {tmp}/shards`"),
        (["empty", out], "INPUT {tmp}/empty is empty"),
        (["noclass", out], "the class folder cat holds no files"),
        (["e.jsonl", out], "holds no lines"),
        (["empty.csv", out], "holds no rows"),
        (["nothing.npz", out], "holds no samples"),
        (["uneven.npz", out], "arrays of different lengths (x 5, y 4)"),
        (["j.jsonl", out, "--shard-mb", "0"], "--shard-mb must be > 0, got 0"),
        (["j.jsonl", out, "--samples-per-shard", "0"], "--samples-per-shard must be >= 1"),
        (["j.jsonl", out, "--shard-mb", "1", "--samples-per-shard", "2"], "not allowed with argument"),
        (["j.jsonl", out, "--kind", "tar"], "cannot be written as tar shards; use --kind jsonl or parquet"),
        (["j.jsonl", out, "--kind", "csv"], "unknown shard kind 'csv'; valid: parquet, jsonl, tar, tfrecord"),
        (["ok", str(tmp / "ok" / "shards")], "is inside INPUT"),
    ]


def test_each_bad_shard_input_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, needle in refusals(tmp_path):
        code, out, err = run_cli(capsys, "data", "shard", *argv)
        assert_one_line_error(code, err, needle.format(tmp=tmp_path))
        assert out == "" and not os.path.exists(tmp_path / "out" / INDEX)


def test_an_existing_set_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "j.jsonl").write_text('{"a": 1}\n')
    assert main(["data", "shard", str(tmp_path / "j.jsonl"), str(tmp_path / "set")]) == 0
    capsys.readouterr()
    before = (tmp_path / "set" / INDEX).read_text()
    code, _, err = run_cli(capsys, "data", "shard", str(tmp_path / "j.jsonl"), str(tmp_path / "set"))
    assert_one_line_error(code, err, f"OUTPUT {tmp_path}/set already holds a shard set (index.json); pass another "
                          "OUTPUT, or remove that set first")
    code, _, err = run_cli(capsys, "data", "index", str(tmp_path / "set"))
    assert_one_line_error(code, err, "already has an index.json; pass --overwrite")
    assert (tmp_path / "set" / INDEX).read_text() == before
    assert main(["data", "index", str(tmp_path / "set"), "--overwrite"]) == 0


def test_index_refuses_mixed_kinds_and_unreadable_shards(capsys, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_shard("jsonl", [{"a": 1}], str(folder / "a.jsonl"))
    pq.write_table(pa.table({"a": [1]}), folder / "b.parquet")
    code, _, err = run_cli(capsys, "data", "index", str(folder))
    assert_one_line_error(code, err, "holds shards of several kinds (1 jsonl, 1 parquet); pass --kind")
    assert main(["data", "index", str(folder), "--kind", "jsonl"]) == 0
    capsys.readouterr()
    assert [s.name for s in ShardIndex.load(str(folder)).shards] == ["a.jsonl"]
    (folder / "c.parquet").write_bytes(b"PAR1 but no more")
    code, _, err = run_cli(capsys, "data", "index", str(folder), "--kind", "parquet", "--overwrite")
    progress, error = err.splitlines()[:-1], err.splitlines()[-1:]  # the shards read before it, then the error
    assert progress == ["shard 1/2: b.parquet, 1 samples"]
    assert_one_line_error(code, error[0], f"c.parquet of {folder}: not a readable parquet shard",
                          "replace or remove it")
    code, _, err = run_cli(capsys, "data", "index", str(tmp_path / "nowhere"))
    assert_one_line_error(code, err, "nowhere is not a folder")


def test_a_bucket_that_does_not_answer_is_the_storage_layers_outage(tmp_path, monkeypatch):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("LAUNCHER_GCS_RETRY_S", "0.5")
    start = time.monotonic()
    with pytest.raises(Unreachable, match=f"cannot read gs://b-1/ds/index.json: the Cloud Storage emulator at "
                                          f"http://127.0.0.1:{port} .* did not answer") as outage:
        ShardIndex.load("gs://b-1/ds")
    # The line gives the time the call really took, not the retry setting (a hanging try outlasts it).
    said = re.search(r"tried for (\d+) s, retries included \(LAUNCHER_GCS_RETRY_S=0.5 bounds", str(outage.value))
    assert said and abs(int(said.group(1)) - (time.monotonic() - start)) < 1.5, str(outage.value)


# -- on Cloud Storage ---------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.gcs
def test_a_set_written_to_and_read_from_the_emulator(gcs, bucket, capsys, tmp_path):
    copies = str(tmp_path / "copies")
    os.makedirs(copies)
    expected = image_folder(tmp_path / "images")
    uri = f"gs://{bucket}/sets/images"
    code, out, err = run_cli(capsys, "data", "shard", str(tmp_path / "images"), uri, "--samples-per-shard", "5",
                             "--keep-order")
    assert code == 0, err
    assert out.strip().endswith(f": {uri} (give this to the training code)")
    index, samples = read_set(uri, copies)
    assert index.uri == uri and [s.samples for s in index.shards] == [5, 5, 2]
    assert [(s["png"], int(s["cls"])) for s in samples] == expected

    code, _, err = run_cli(capsys, "data", "shard", str(tmp_path / "images"), uri)
    assert_one_line_error(code, err, f"OUTPUT {uri} already holds a shard set")
    _, client = gcs
    client.bucket(bucket).blob("sets/images/index.json").delete()  # as if the writing had been cut off
    with pytest.raises(UserError, match=f"{uri} has no index.json"):
        ShardIndex.load(uri)
    code, out, err = run_cli(capsys, "data", "index", uri)
    assert code == 0, err
    assert read_set(uri, copies)[1] == samples


# -- unfinished sets: a set cut off while it was written never passes as whole ------------------

def stop_after(n: int, error: BaseException):
    """A progress callback that raises ``error`` once ``n`` shards are written (as Ctrl-C would)."""

    def note(line: str) -> None:
        if line.startswith(f"shard {n}/"):
            raise error
    return note


def twenty(tmp_path) -> str:
    np.savez(tmp_path / "in.npz", x=np.arange(40, dtype=np.int64).reshape(20, 2))
    return str(tmp_path / "in.npz")


def assert_known_unfinished(capsys, folder, written: int) -> None:
    """``data index``, ``bench input`` and a training read all refuse the folder, saying why."""
    said = f"{folder} holds an unfinished shard set ({written} shard file"
    code, _, err = run_cli(capsys, "data", "index", str(folder))
    assert_one_line_error(code, err, said, "indexing it would pass a part off as the whole", "launcher data shard")
    code, _, err = run_cli(capsys, "data", "index", str(folder), "--overwrite")
    assert_one_line_error(code, err, said)
    code, _, err = run_cli(capsys, "bench", "input", str(folder))
    assert_one_line_error(code, err, said, "again: it replaces them")
    from launcher.data import Shards

    with pytest.raises(UserError, match="holds an unfinished shard set"):
        Shards(str(folder))
    assert not (folder / INDEX).exists()


def test_an_interrupted_set_is_unfinished_to_every_reader_and_a_new_try_replaces_it(capsys, tmp_path):
    source, out = twenty(tmp_path), tmp_path / "out"
    with pytest.raises(KeyboardInterrupt) as stopped:
        writer.shard(source, str(out), samples_per_shard=4, note=stop_after(3, KeyboardInterrupt()))
    assert str(stopped.value) == (f"{out} now holds an unfinished shard set (3 of 5 shards), which no reader "
                                  f"takes; run `launcher data shard {source} {out}` again to write it whole "
                                  "(it replaces them)")
    assert sorted(os.listdir(out)) == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet",
                                       "unfinished.json"]
    assert_known_unfinished(capsys, out, 3)
    # The same command again, with larger shards: the cut-off try's three shards do not stay beside them.
    code, _, err = run_cli(capsys, "data", "shard", source, str(out), "--samples-per-shard", "10")
    assert code == 0 and f"{out} holds an unfinished shard set (3 shard files of about 5" in err
    assert sorted(os.listdir(out)) == ["index.json", "shard-00000.parquet", "shard-00001.parquet"]
    _, samples = read_set(str(out))
    assert [int(s["x"][0]) for s in samples] == list(range(0, 40, 2))


def test_a_failure_while_writing_says_the_folder_holds_a_part(tmp_path):
    source, out = twenty(tmp_path), tmp_path / "out"
    with pytest.raises(UserError) as failed:
        writer.shard(source, str(out), samples_per_shard=4, note=stop_after(2, UserError("the disk filled up")))
    assert str(failed.value) == (f"the disk filled up; {out} now holds an unfinished shard set (2 of 5 shards), "
                                 f"which no reader takes; run `launcher data shard {source} {out}` again to "
                                 "write it whole (it replaces them)")
    assert (out / "unfinished.json").exists() and not (out / INDEX).exists()


def test_a_bad_json_line_is_refused_before_any_shard(capsys, tmp_path):
    lines = [json.dumps({"a": i}) for i in range(50)] + ["{not json"]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    code, _, err = run_cli(capsys, "data", "shard", str(tmp_path / "t.jsonl"), str(tmp_path / "out"),
                           "--samples-per-shard", "5")
    assert_one_line_error(code, err, "t.jsonl: line 51 is not JSON")
    assert not (tmp_path / "out").exists()  # checked before anything was written


def test_shard_files_without_an_index_or_a_note_are_not_mixed_into_a_new_set(capsys, tmp_path):
    source, out = twenty(tmp_path), tmp_path / "out"
    writer.shard(source, str(out), samples_per_shard=4)
    os.remove(out / INDEX)  # e.g. written by an older launcher that was cut off
    code, _, err = run_cli(capsys, "data", "shard", source, str(out))
    assert_one_line_error(code, err, f"OUTPUT {out} holds 5 shard files (shard-00000.parquet, shard-00001.parquet, "
                          "...) and no index.json", f"launcher data index {out}")
    code, _, err = run_cli(capsys, "bench", "input", str(out))
    assert_one_line_error(code, err, "has no index.json: not a shard set", f"launcher data index {out}")


@pytest.mark.integration
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_while_sharding_exits_130_naming_the_unfinished_set(capsys, tmp_path, signame):
    import signal
    import subprocess
    import sys
    import time

    source, out, mark = twenty(tmp_path), tmp_path / "out", tmp_path / "mark"
    env = dict(os.environ, LAUNCHER_FAULT_PAUSE="shard-written:60", LAUNCHER_FAULT_MARK=str(mark))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "data", "shard", source, str(out),
                             "--samples-per-shard", "4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == (f"interrupted: {out} now holds an unfinished shard set (1 of 5 shards), which "
                                    f"no reader takes; run `launcher data shard {source} {out}` again to write it "
                                    "whole (it replaces them)")
    assert_known_unfinished(capsys, out, 1)


# -- what a reader checks -----------------------------------------------------------------------

def test_a_damaged_local_shard_is_refused_on_its_first_read(tmp_path):
    from launcher.data import Shards

    index = writer.shard(twenty(tmp_path), str(tmp_path / "set"), samples_per_shard=5)
    path = tmp_path / "set" / index.shards[1].name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    path.write_bytes(bytes(data))
    whole = Shards(str(tmp_path / "set"))
    assert int(whole[0]["x"][0]) == 0  # the undamaged shards read
    with pytest.raises(ShardError, match=f"shard-00001.parquet of {index.uri}: its sha256 differs"):
        whole[5]
    assert whole._local.cache.verify_s > 0


def test_a_missing_local_shard_is_named_as_missing_every_time(tmp_path):
    from launcher.data import Shards

    index = writer.shard(twenty(tmp_path), str(tmp_path / "set"), samples_per_shard=5)
    os.remove(tmp_path / "set" / index.shards[2].name)
    for _ in range(6):  # the read-ahead threads reach the shard first in some tries, the read in others
        data = Shards(str(tmp_path / "set"), window=1)
        data.upcoming(range(20))
        with pytest.raises(ShardError) as missing:
            [data[i] for i in range(20)]
        assert str(missing.value) == (f"shard-00002.parquet of {index.uri}: the file is missing; put it back, or "
                                      "write the set again with `launcher data shard`")
        data.close()


def test_files_that_are_not_images_are_left_out_and_named(capsys, tmp_path):
    expected = image_folder(tmp_path / "imgs", classes=("cat", "dog"), per_class=3)
    (tmp_path / "imgs" / "cat" / "notes.png").write_text("these are my notes, not a picture")
    (tmp_path / "imgs" / "dog" / "README.txt").write_text("dogs")
    code, out, err = run_cli(capsys, "data", "shard", str(tmp_path / "imgs"), str(tmp_path / "set"))
    assert code == 0, err
    assert "left out cat/notes.png (not an image pillow recognises)" in err
    assert "left out dog/README.txt (not an image pillow recognises)" in err
    assert "left out 2 files that pillow does not read as images" in err
    index, samples = read_set(str(tmp_path / "set"))
    assert index.samples == 6 and out.startswith("1 tar shards, 6 samples")
    assert sorted(s["png"] for s in samples) == sorted(data for data, _ in expected)


def test_bench_input_on_a_file_says_to_shard_it(capsys, tmp_path):
    pyarrow.csv.write_csv(pa.table({"a": [1, 2]}), tmp_path / "t.csv")
    code, _, err = run_cli(capsys, "bench", "input", str(tmp_path / "t.csv"))
    assert_one_line_error(code, err, f"{tmp_path}/t.csv is a file, not a shard set",
                          f"launcher data shard {tmp_path}/t.csv OUTPUT_FOLDER")
