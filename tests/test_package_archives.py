"""Built trainer packages as ``--package``: sdists and wheels, local or gs://, checked on the driver
(launcher/driver/archives.py, launcher/driver/program.py), with the driver's PIP_* options for
every node's install. Installed on every node and run from the installed package on a 2-node
cluster: tests/test_programs.py's test_an_sdist_by_path_then_by_gs_uri_trains_on_two_nodes_and_resumes,
on the cluster that module starts once for its runs across nodes."""

from __future__ import annotations

import io
import os
import socket
import tarfile
import zipfile

import pytest

from launcher.cli.main import main
from launcher.driver import archives, jobs
from launcher.driver.dependencies import setup_py_dependencies
from launcher.driver.program import from_package
from launcher.errors import Unreachable, UserError
from launcher.worker import deps
from launcher.worker.deps import WORKING_DIR_VAR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "trainer_package")
TASK = "import json\nfrom trainer import model\nprint('trained', model.X)\n"
MODEL = "X = 1\n"
SETUP = "from setuptools import setup, find_packages\nsetup(name='trainer', version='0.1', packages=find_packages(), " \
        "install_requires={requires!r})\n"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Fetched archives and shipped folders go to this test's own cache."""
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))


def write_sdist(path, files: dict[str, str] | None = None, requires: list[str] | None = None,
                pkg_info: bool = True, top: str = "trainer-0.1") -> str:
    """A .tar.gz laid out as `python setup.py sdist` writes one (NAME-VER/ and PKG-INFO, setup.py)."""
    files = {"trainer/__init__.py": "", "trainer/task.py": TASK, "trainer/model.py": MODEL,
             "setup.py": SETUP.format(requires=requires or []), **(files or {})}
    if pkg_info:
        files["PKG-INFO"] = "Metadata-Version: 2.4\nName: trainer\nVersion: 0.1\n" + \
            "".join(f"Requires-Dist: {r}\n" for r in requires or [])
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            if text is None:
                continue
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def write_wheel(path, files: dict[str, str] | None = None, requires: list[str] | None = None,
                metadata: bool = True) -> str:
    """A .whl as pip wheel writes one: the packages at the top, NAME-VER.dist-info/METADATA."""
    name = os.path.basename(str(path)).split("-")[0]
    files = {"trainer/__init__.py": "", "trainer/task.py": TASK, "trainer/model.py": MODEL, **(files or {})}
    if metadata:
        files[f"{name}-0.1.dist-info/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n" + \
            "".join(f"Requires-Dist: {r}\n" for r in requires or [])
        files[f"{name}-0.1.dist-info/WHEEL"] = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            if text is not None:
                zf.writestr(member, text)
    return str(path)


# -- what a built package becomes ------------------------------------------------------------------

def test_an_sdist_is_a_program_that_each_node_installs(tmp_path, monkeypatch):
    sdist = write_sdist(tmp_path / "trainer-0.1.tar.gz", requires=["cloudml-hypertune"])
    program = from_package(sdist, "trainer.task")
    assert (program.kind, program.target, program.archives) == ("module", "trainer.task", ("trainer-0.1.tar.gz",))
    assert program.requirements == (f"{WORKING_DIR_VAR}/trainer-0.1.tar.gz",)  # pip installs it, and its deps
    assert program.packages == (sdist,) and program.label == "module:trainer.task (trainer-0.1.tar.gz)"
    # shipped: a folder holding only the archive, named after its content (a later launch: the same)
    assert os.listdir(program.folder) == ["trainer-0.1.tar.gz"] and program.folder.startswith(str(tmp_path / "cache"))
    assert program.runtime_env()["working_dir"] == program.folder
    assert from_package(sdist, "trainer.task").folder == program.folder
    config = program.to_config(True)
    assert config["archives"] == ["trainer-0.1.tar.gz"] and config["env_key"]
    # a submitted job runs in the shipped folder: the flags name the shipped file
    assert program.to_argv() == ["--package", "trainer-0.1.tar.gz", "--module", "trainer.task"]
    monkeypatch.chdir(program.folder)
    assert from_package("trainer-0.1.tar.gz", "trainer.task").folder == program.folder


def test_several_archives_install_in_order_and_the_module_is_found_in_any(tmp_path):
    lib = write_wheel(tmp_path / "helpers-0.1-py3-none-any.whl", files={
        "trainer/__init__.py": None, "trainer/task.py": None, "trainer/model.py": None,
        "helpers/__init__.py": "Y = 2\n"})
    sdist = write_sdist(tmp_path / "trainer-0.1.tar.gz", files={"trainer/task.py": "import helpers\nprint(1)\n"})
    program = from_package(f"{lib},{sdist}", "trainer.task")  # helpers: from the first one
    assert program.archives == ("helpers-0.1-py3-none-any.whl", "trainer-0.1.tar.gz")
    assert program.requirements == tuple(f"{WORKING_DIR_VAR}/{n}" for n in program.archives)
    assert program.label == "module:trainer.task (helpers-0.1-py3-none-any.whl, trainer-0.1.tar.gz)"
    assert program.to_argv()[:2] == ["--package", "helpers-0.1-py3-none-any.whl,trainer-0.1.tar.gz"]
    assert sorted(os.listdir(program.folder)) == sorted(program.archives)


def test_a_wheel_and_an_src_layout_sdist(tmp_path):
    wheel = write_wheel(tmp_path / "trainer-0.1-py3-none-any.whl", requires=["cloudml-hypertune"])
    assert from_package(wheel, "trainer.task").archives == ("trainer-0.1-py3-none-any.whl",)
    src = write_sdist(tmp_path / "trainer-0.1.tar.gz", files={
        "trainer/__init__.py": None, "trainer/task.py": None, "trainer/model.py": None,
        "src/trainer/__init__.py": "", "src/trainer/task.py": TASK, "src/trainer/model.py": MODEL})
    archive = archives.open_archive(src, src)
    assert archive.module_file("trainer.task") == "trainer/task.py" and archive.top_level() == ["trainer"]
    assert from_package(src, "trainer.task").target == "trainer.task"


def test_declared_dependencies_are_read_from_the_archive(tmp_path):
    def declared(path):
        return archives.open_archive(path, path).declared_requirements(setup_py_dependencies)

    assert declared(write_sdist(tmp_path / "a-1.tar.gz", requires=["extra>=1", "PyYAML"])) == ["extra>=1", "PyYAML"]
    # an old sdist's PKG-INFO without Requires-Dist: setup.py says
    assert declared(write_sdist(tmp_path / "b-1.tar.gz", requires=["extra"], pkg_info=False)) == ["extra"]
    computed = write_sdist(tmp_path / "c-1.tar.gz", pkg_info=False, files={
        "setup.py": "from setuptools import setup\nsetup(name='t', install_requires=deps())\n"})
    assert declared(computed) is None  # cannot know without building it
    assert declared(write_wheel(tmp_path / "t-0.1-py3-none-any.whl", requires=["extra; python_version>'3'"])) == \
        ["extra; python_version>'3'"]
    # what the module imports and only a declared dependency provides is not refused ...
    bold = {"trainer/task.py": "import yaml_by_another_name\n"}
    from_package(write_sdist(tmp_path / "d" / "trainer-0.1.tar.gz", files=bold, requires=["PyYAML"]), "trainer.task")
    from_package(write_sdist(tmp_path / "e" / "trainer-0.1.tar.gz", files={
        **bold, "setup.py": "from setuptools import setup\nsetup(name='t', install_requires=deps())\n"},
        pkg_info=False), "trainer.task")
    # ... but with nothing declared, it is caught here, not on every node
    with pytest.raises(UserError, match=r"--module trainer.task in trainer-0.1.tar.gz: trainer/task.py line 1 "
                                        r"imports yaml_by_another_name, which is not in trainer-0.1.tar.gz"):
        from_package(write_sdist(tmp_path / "f" / "trainer-0.1.tar.gz", files=bold), "trainer.task")


def _truncated(path) -> str:
    write_sdist(path, files={"trainer/data.py": "x = '%s'\n" % os.urandom(20000).hex()})
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    return str(path)


def _garbage(path) -> str:
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 this is not really a zip file")
    return str(path)


@pytest.mark.parametrize("make, module, message", [
    (lambda t: write_sdist(t / "trainer.zip"), "trainer.task", "trainer.zip: not a folder, and not an sdist or wheel"),
    (lambda t: str(t / "missing-0.1.tar.gz"), "trainer.task", "missing-0.1.tar.gz: no such file"),
    (lambda t: f"{write_sdist(t / 'a-0.1.tar.gz')},{t / 'notes.txt'}", "trainer.task",
     "notes.txt: not an sdist or wheel"),
    (lambda t: f"{write_sdist(t / 'a-0.1.tar.gz')},{t}", "trainer.task", "a folder, with other packages"),
    (lambda t: "https://example.com/trainer-0.1.tar.gz", "trainer.task", "only local paths and gs:// URIs"),
    (lambda t: _truncated(t / "trainer-0.1.tar.gz"), "trainer.task", "the archive is corrupt or truncated"),
    (lambda t: _garbage(t / "trainer-0.1-py3-none-any.whl"), "trainer.task", "the archive is corrupt or truncated"),
    (lambda t: write_wheel(t / "trainer.whl"), "trainer.task", "not a wheel's name"),
    (lambda t: write_wheel(t / "trainer-0.1-py3-none-any.whl", metadata=False), "trainer.task",
     r"not a wheel \(no \*.dist-info/METADATA"),
    (lambda t: write_sdist(t / "trainer-0.1.tar.gz", top=""), "trainer.task", "not an sdist"),
    (lambda t: write_sdist(t / "trainer-0.1.tar.gz", files={"other/__init__.py": "", "tool.py": ""}),
     "trainer.nothing", r"no trainer/nothing.py .* in trainer-0.1.tar.gz \(it has: other, tool, trainer\)"),
    (lambda t: write_sdist(t / "trainer-0.1.tar.gz", files={"trainer/model.py": "def f(:\n"}), "trainer.task",
     "in trainer-0.1.tar.gz: trainer/model.py line 1: syntax error"),
    (lambda t: write_sdist(t / "trainer-0.1.tar.gz"), "trainer-task", "not a dotted module name"),
])
def test_a_built_package_that_cannot_run_is_one_clear_error(tmp_path, make, module, message):
    package = make(tmp_path)
    with pytest.raises(UserError, match=message):
        from_package(package, module)


def test_a_bad_archive_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys):
    code = main(["run", "--package", _truncated(tmp_path / "trainer-0.1.tar.gz"), "--module", "trainer.task",
                 "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "corrupt or truncated" in err[0], err
    assert not (tmp_path / "runs").exists()


# -- gs:// -----------------------------------------------------------------------------------------

@pytest.mark.gcs
def test_a_package_on_cloud_storage_is_fetched_once_and_shipped_like_a_local_one(tmp_path, gcs, bucket):
    _, client = gcs
    sdist = write_sdist(tmp_path / "trainer-0.1.tar.gz", requires=["cloudml-hypertune"])
    client.bucket(bucket).blob("code/trainer-0.1.tar.gz").upload_from_filename(sdist)
    uri = f"gs://{bucket}/code/trainer-0.1.tar.gz"
    program = from_package(uri, "trainer.task")
    assert program.packages == (uri,) and program.label == "module:trainer.task (trainer-0.1.tar.gz)"
    assert program.folder == from_package(sdist, "trainer.task").folder  # the same archive, the same folder
    with pytest.raises(UserError, match=f"--package gs://{bucket}/code/trainer-0.2.tar.gz: no such object"):
        from_package(f"gs://{bucket}/code/trainer-0.2.tar.gz", "trainer.task")
    with pytest.raises(UserError, match="the bucket no-such-bucket-here does not exist"):
        from_package("gs://no-such-bucket-here/trainer-0.1.tar.gz", "trainer.task")


def test_storage_that_does_not_answer_is_an_outage_not_bad_input(tmp_path, monkeypatch, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("LAUNCHER_GCS_RETRY_S", "1")
    with pytest.raises(Unreachable, match=f"cannot read gs://b-1/trainer-0.1.tar.gz: the Cloud Storage emulator "
                                          f"at http://127.0.0.1:{port} .* did not answer"):
        from_package("gs://b-1/trainer-0.1.tar.gz", "trainer.task")
    code = main(["run", "--package", "gs://b-1/trainer-0.1.tar.gz", "--module", "trainer.task",
                 "--storage", str(tmp_path / "runs")])
    assert code == 1 and "did not answer" in capsys.readouterr().err


# -- pip's options go with the program -----------------------------------------------------------

def test_the_drivers_pip_options_go_to_every_node(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    assert deps.pip_env({"PIP_INDEX_URL": "https://mirror/simple", "PYTHONPATH": "x"}) == \
        {"PIP_INDEX_URL": "https://mirror/simple"}
    program = from_package(write_sdist(tmp_path / "trainer-0.1.tar.gz"), "trainer.task")
    pip = program.to_config(True)["pip_env"]
    assert pip["PIP_NO_INDEX"] == "1" and pip["PIP_FIND_LINKS"] == str(tmp_path / "wheels")
    env = jobs.runtime_env({"PIP_NO_INDEX": "1", "HOME": "/root"}, program=program)  # a submitted job's too
    assert env["env_vars"]["PIP_NO_INDEX"] == "1" and "HOME" not in env["env_vars"]
    assert env["working_dir"] == program.folder
