"""Workloads the user writes: ``path/to/file.py:NAME`` or ``package.module:NAME``.

:func:`load_reference` imports the file or module and returns the workload it
names, after :func:`check_declaration` made sure it has what the training loop
will ask of it (a data function, a model per framework it claims, shapes,
defaults); :func:`check_data` then tries its data function as rank 0 would run
it. So a mistake is one clear line before any worker starts. A reference to a
file works on any node: the launcher ships the file's folder with Ray's
runtime environment (``working_dir``) and sets :data:`SHIPPED_ENV`, and there
the shipped copy is used, not whatever may be at the same path on that node.

Like the rest of ``workloads``, nothing here imports the launcher or Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from workloads import function
from workloads.base import Defaults, Workload
from workloads.tf_models import native_stderr_silenced

FRAMEWORKS = ("torch", "tensorflow")
# Set to 1 (by the launcher, through Ray's runtime environment) where the workload's folder
# was shipped as the job's working_dir. Ray puts that folder on PYTHONPATH; the worker's
# current directory is not it (Ray Train moves workers into the run's artifacts folder).
SHIPPED_ENV = "LAUNCHER_WORKLOAD_CODE"
_lock = threading.Lock()
_loaded: dict[str, Workload] = {}
# Frameworks a user's file imports that the launcher's driver only needs loaded if the file uses
# them while it is imported (a model class defined at its top, say): see defer_framework_imports.
DEFERRABLE = ("tensorflow", "torch")
_deferring = threading.local()
_deferred: set[str] = set()  # the DEFERRABLE frameworks a user's file got as modules loaded on first use


class WorkloadError(ValueError):
    """A user workload that cannot be used; str() says what is wrong and how to fix it."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what


@dataclass(frozen=True)
class Reference:
    """Where a user workload lives: a file (``path``) or an importable module (``module``)."""

    text: str               # as given, e.g. "models/my.py:Net"
    attribute: str          # the object's name in the file or module
    path: str | None = None     # absolute path of the .py file
    module: str | None = None   # dotted module name

    @property
    def canonical(self) -> str:
        """The reference with an absolute path, as the spec and the workers carry it."""
        return f"{self.path or self.module}:{self.attribute}"


def is_reference(name: str) -> bool:
    """Whether a --workload value names user code (``...:NAME``) rather than a built-in."""
    return ":" in name


def parse_reference(text: str, cwd: str | None = None) -> Reference:
    """Split ``FILE.py:NAME`` or ``package.module:NAME``; a file path is made absolute.

    Raises:
        WorkloadError: malformed (no NAME, no file or module part).
    """
    where, _, attribute = text.rpartition(":")
    if not where or not attribute.isidentifier():
        raise WorkloadError(f"--workload {text!r} is not FILE.py:NAME or package.module:NAME "
                            "(NAME: the workload object in that file or module)")
    if where.endswith(".py") or os.sep in where or where.startswith("."):
        path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(where)))
        return Reference(text, attribute, path=path)
    if not all(part.isidentifier() for part in where.split(".")):
        raise WorkloadError(f"--workload {text!r}: {where!r} is neither a .py file nor a module name",
                            "write path/to/file.py:NAME or package.module:NAME")
    return Reference(text, attribute, module=where)


def load_reference(text: str) -> Workload:
    """The workload a reference names, imported once per process and checked (:func:`check_declaration`)."""
    with _lock:
        if text not in _loaded:
            ref = parse_reference(text)
            _loaded[text] = _as_workload(_import_object(ref), ref)
        return _loaded[text]


def companion(text: str, name: str) -> Callable | None:
    """The function ``name`` defined beside the workload ``text`` names (in the same file or
    module, imported once per process), or None when there is none.

    Raises:
        WorkloadError: the file or module cannot be imported.
    """
    ref = parse_reference(text)
    with _lock:
        module = _import_file(ref) if ref.path else _import_module(ref)
    found = getattr(module, name, None)
    return found if callable(found) else None


def _import_object(ref: Reference) -> Any:
    quiet = contextlib.nullcontext()
    if "tensorflow" not in sys.modules:
        # The launcher trains with the legacy tf.keras: a file importing TensorFlow must get it.
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        if ref.path and _mentions_tensorflow(ref.path):
            quiet = native_stderr_silenced()  # TensorFlow's C++ start-up notes (no GPU, CPU features)
    with quiet, _frameworks_deferred():
        module = _import_file(ref) if ref.path else _import_module(ref)
    if not hasattr(module, ref.attribute):
        candidates = sorted(k for k, v in vars(module).items()
                            if isinstance(v, Workload) or (isinstance(v, type) and issubclass(v, Workload)
                                                           and v is not Workload)
                            or (function.kind_of(v) is not None and getattr(v, "__module__", None) == module.__name__))
        hint = (f"it defines: {', '.join(candidates)}" if candidates
                else "define a Workload (or a subclass), or a training function def NAME(session), under that name")
        raise WorkloadError(f"--workload {ref.text}: {_where(ref)} has no {ref.attribute!r}; {hint}")
    return getattr(module, ref.attribute)


@contextlib.contextmanager
def defer_framework_imports() -> Iterator[None]:
    """Meanwhile, in this thread, a user's file that imports TensorFlow or torch (not loaded yet)
    gets the module loaded on its first use, not at the ``import`` line (importlib's LazyLoader).

    For the driver of a run, which imports the user's file only to find and check its workload:
    a Keras function's file otherwise loaded TensorFlow there (2.9-3.4 s of the driver's start on
    2 cores, against 0.3-0.4 s for a built-in workload), and a file whose torch code is all in its
    functions, torch (~1.5 s); its workers load them anyway. A name the file uses at its top level
    (``class Net(nn.Module)``) loads the framework at once, as before; a framework that is not
    installed still fails the import, in one line. TensorFlow's C++ start-up notes are silenced
    whenever it loads.
    """
    before = getattr(_deferring, "on", False)
    _deferring.on = True
    try:
        yield
    finally:
        _deferring.on = before


class _Quiet(importlib.abc.Loader):
    """A loader that silences native stderr while the module it wraps executes."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with native_stderr_silenced():
            self.loader.exec_module(module)

    def __getattr__(self, name: str):  # resource readers and the like: the wrapped loader's
        if name == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class _OnFirstUse(importlib.abc.MetaPathFinder):
    """Finds the DEFERRABLE frameworks as modules loaded on first use (LazyLoader)."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in DEFERRABLE or name in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None  # not installed (the import fails as it would have), or not a plain package
        loader = _Quiet(spec.loader) if name == "tensorflow" else spec.loader
        spec.loader = importlib.util.LazyLoader(loader)
        _deferred.add(name)
        return spec


def not_loaded_yet(name: str) -> bool:
    """Whether the framework ``name`` is imported but not loaded: a module that loads on its first
    use (:func:`defer_framework_imports`), which nothing has used yet. Asking does not load it."""
    module = sys.modules.get(name)
    return name in _deferred and module is not None and type(module) is not types.ModuleType


@contextlib.contextmanager
def _frameworks_deferred() -> Iterator[None]:
    if not getattr(_deferring, "on", False):
        yield
        return
    finder = _OnFirstUse()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _mentions_tensorflow(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    return "tensorflow" in text or "keras" in text


def _where(ref: Reference) -> str:
    return ref.path if ref.path else f"module {ref.module}"


def _shipped_copy(ref: Reference) -> str | None:
    """The copy of the file that came with Ray's runtime environment, on a node that got one:
    in the shipped working directory, which Ray puts on PYTHONPATH."""
    if os.environ.get(SHIPPED_ENV) != "1":
        return None
    folders = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    folders.sort(key=lambda p: "working_dir" not in p)  # Ray's working_dir_files/... first
    for folder in folders:
        candidate = os.path.join(folder, os.path.basename(ref.path))
        if os.path.isfile(candidate):
            return candidate
    return None


def _import_file(ref: Reference) -> Any:
    path = _shipped_copy(ref) or ref.path  # the shipped code wins over a stale copy at the same path
    if not os.path.isfile(path):
        if os.path.exists(path):
            raise WorkloadError(f"--workload {ref.text}: {ref.path} is not a file", "give the path of a .py file")
        else:
            raise WorkloadError(f"--workload {ref.text}: no such file {ref.path}",
                                "check the path (relative paths start from the current folder)")
    # A stable, unique module name per file, so two workloads called model.py do not collide.
    stem = os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    name = f"launcher_user_{hashlib.sha1(ref.path.encode()).hexdigest()[:10]}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the workload's own helper modules import from beside it
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise WorkloadError(f"--workload {ref.text}: syntax error in {exc.filename}, line {exc.lineno}: {exc.msg}",
                            "fix the file") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises while importing
        del sys.modules[name]
        raise WorkloadError(f"--workload {ref.text}: importing {ref.path} failed: {_one_line(exc)}",
                            "run `python " + ref.path + "` to see the whole error") from None
    return module


def _import_module(ref: Reference) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # importable from the current directory, as `python -m` would
    try:
        return importlib.import_module(ref.module)
    except ModuleNotFoundError as exc:
        if exc.name and ref.module.startswith(exc.name):
            raise WorkloadError(f"--workload {ref.text}: no module named {exc.name!r} here",
                                "run from the folder that holds it, install it, or give FILE.py:NAME") from None
        raise WorkloadError(f"--workload {ref.text}: importing {ref.module} failed: {_one_line(exc)}") from None
    except SyntaxError as exc:
        raise WorkloadError(f"--workload {ref.text}: syntax error in {exc.filename}, line {exc.lineno}: {exc.msg}",
                            "fix the file") from None
    except Exception as exc:  # noqa: BLE001
        raise WorkloadError(f"--workload {ref.text}: importing {ref.module} failed: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _as_workload(obj: Any, ref: Reference) -> Workload:
    """A Workload instance from what the name holds: an instance, a subclass or a factory."""
    if isinstance(obj, type) and issubclass(obj, Workload):
        try:
            obj = obj()
        except TypeError as exc:
            raise WorkloadError(f"--workload {ref.text}: {obj.__name__}() needs arguments ({exc})",
                                "give it defaults, or name an instance of it instead") from None
    elif function.kind_of(obj) is not None:  # the user's own loop: def train(session) / (config)
        return function.TrainingFunction(obj, ref.text, function.kind_of(obj))
    elif callable(obj) and not isinstance(obj, Workload):
        needs = function.required_parameters(obj)
        if needs:
            raise WorkloadError(f"--workload {ref.text}: {ref.attribute} is a function, not a workload: it takes "
                                f"{len(needs)} parameters ({', '.join(needs)})",
                                "a training function takes one, the session: def NAME(session); a function "
                                "that makes a workload takes none")
        obj = obj()
    if not isinstance(obj, Workload):
        raise WorkloadError(f"--workload {ref.text}: {ref.attribute} is a {type(obj).__name__}, not a workload",
                            "make it a workloads.Workload, or a training function def NAME(session) "
                            "(see the README's 'Bring your own model' and 'Your own training loop')")
    check_declaration(obj, ref.text)
    return obj


# -- what a workload must provide ------------------------------------------------------------

MODEL_METHODS = {"torch": "torch_model", "tensorflow": "tf_model"}


def _overrides(workload: Workload, method: str) -> bool:
    return getattr(type(workload), method) is not getattr(Workload, method) or method in vars(workload)


def check_declaration(workload: Workload, where: str) -> None:
    """The parts every workload needs are there (no data is read).

    Raises:
        WorkloadError: naming the first missing or malformed part and how to add it.
    """
    if not isinstance(workload.name, str) or not workload.name:
        raise WorkloadError(f"--workload {where}: the workload has no name", "pass name=... to Workload")
    if not isinstance(workload.defaults, Defaults):
        raise WorkloadError(f"--workload {where}: defaults must be a workloads.Defaults, "
                            f"not {type(workload.defaults).__name__}",
                            "for example defaults=Defaults(epochs=5, batch_size=32, lr=0.001)")
    if workload.defaults.optimizer not in ("adam", "sgd"):
        raise WorkloadError(f"--workload {where}: unknown optimizer {workload.defaults.optimizer!r}",
                            "use Defaults(optimizer='adam') or 'sgd'")
    frameworks = tuple(workload.frameworks)
    if not frameworks or any(f not in FRAMEWORKS for f in frameworks):
        raise WorkloadError(f"--workload {where}: frameworks must name torch and/or tensorflow, got {frameworks}")
    if not _overrides(workload, "load"):
        raise WorkloadError(f"--workload {where}: the workload has no data: define load(self, data, split, rank, "
                            "world_size, params) returning this rank's shard (see workloads.shard)")
    for name in ("input_shape", "num_classes") if workload.is_classifier else ("input_shape",):
        if not _overrides(workload, name):
            raise WorkloadError(f"--workload {where}: the workload does not define {name}(self, params)")
    for framework in frameworks:
        method = MODEL_METHODS[framework]
        if not _overrides(workload, method):
            raise WorkloadError(f"--workload {where}: it says it supports {framework} but defines no "
                                f"{method}(self, params)", f"add {method}, or drop {framework} from frameworks")


def check_data(workload: Workload, where: str, data: str | None, params: Mapping[str, Any],
               world_size: int) -> None:
    """Load rank 0's shards as the workers will and check them: lengths agree, inputs have
    the declared shape, labels are classes, the train shard is not empty.

    Raises:
        WorkloadError: naming the split and what is wrong.
    """
    if isinstance(workload, function.TrainingFunction):
        return  # it reads its own data, inside its loop
    shape = tuple(workload.input_shape(params))
    classes = int(workload.num_classes(params)) if workload.is_classifier else None
    for split in ("train", "test"):
        try:
            part = workload.load(data, split, 0, world_size, params)
        except WorkloadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's data function
            raise WorkloadError(f"--workload {where}: load(split={split!r}, rank=0, world_size={world_size}) "
                                f"failed: {_one_line(exc)}") from None
        if not hasattr(part, "take") or not hasattr(part, "__len__"):
            raise WorkloadError(f"--workload {where}: load({split!r}) returned a {type(part).__name__}",
                                "return workloads.shard(x, y, split, rank, world_size) (arrays) or "
                                "workloads.shard(dataset, None, ...) (a dataset)")
        if split == "train" and len(part) == 0:
            raise WorkloadError(f"--workload {where}: rank 0's train shard is empty with {world_size} workers",
                                "give it more data or use fewer --workers")
        if len(part):
            x, y = part.take(np.arange(min(len(part), 4)))
            if tuple(x.shape[1:]) != shape:
                raise WorkloadError(f"--workload {where}: {split} inputs have shape {tuple(x.shape[1:])}, "
                                    f"but input_shape() says {shape}", "make them agree")
            if classes is not None and len(y) and y.dtype.kind == "f":
                raise WorkloadError(f"--workload {where}: {split} labels are real numbers, but the workload is a "
                                    "classifier (it keeps the default cross-entropy loss)",
                                    "give class labels 0..num_classes-1, or define torch_loss (e.g. F.mse_loss)")
            if classes is not None and len(y) and (y.min() < 0 or y.max() >= classes):
                raise WorkloadError(f"--workload {where}: {split} labels run {y.min()}..{y.max()}, outside "
                                    f"0..{classes - 1} (num_classes() is {classes})", "make them agree")
