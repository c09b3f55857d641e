"""Horovod ring-allreduce over Gloo, on Ray Train V2.

Ray 2.60 dropped HorovodTrainer from Train V2, and V1's HorovodConfig cannot
drive a V2 worker group. This module is the replacement, in two halves:

* Driver side: :class:`HorovodBackend` (the registry entry: availability,
  the trainer). The Ray Train BackendConfig/Backend pair that starts the Gloo
  rendezvous, and the ring positions from the workers' real node placement,
  are in :mod:`launcher.backends.horovod_train` (it imports Ray, so the CLI
  loads it only when training).
* Worker side: :class:`HorovodComm`, the TorchComm of the generic torch loop.

Horovod itself is imported only where it runs (the controller and the
workers); the driver only probes for it, in a subprocess, once per build: a probe that passed
is recorded under ``$LAUNCHER_CACHE`` with what it depended on (:func:`_fingerprint`), and a
later launch whose fingerprint matches skips it (the probe imported the framework and Horovod's
extension: 2.2 s of a torch launch's start, 5.1 s of a TensorFlow one's, measured here).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import warnings

from launcher import _deferred, frameworks, settings
from launcher.backends.base import Backend, TFComm, TorchComm

HVD_VERSION = "0.28.1"
BUILD_HINT = ("build it with `scripts/install-horovod {python}` (about 8 minutes; needs g++ and cmake 3.x), "
              "then check with `launcher doctor`")
# What each framework's Horovod extension is called, and the env its import needs.
EXTENSIONS = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}
PROBE_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


# -- availability (driver side; no Horovod import in this process) -------------------------

def installed() -> bool:
    """Whether a Horovod package is here at all (cheap: nothing is imported)."""
    return importlib.util.find_spec("horovod") is not None


@functools.lru_cache(maxsize=None)
def probe(framework: str) -> str | None:
    """None when Horovod with ``framework`` and Gloo imports here; otherwise why not. Only a
    probe that passed is recorded (a failure is probed again: its cause may be fixed by then)."""
    if not installed():
        return "Horovod is not installed"
    fingerprint = _fingerprint(framework)
    if fingerprint is not None and _probed().get(framework) == fingerprint:
        return None
    why = _probe_now(framework)
    if why is None and fingerprint is not None:
        _record(framework, fingerprint)
    return why


def _probe_now(framework: str) -> str | None:
    module = EXTENSIONS[framework]
    code = (f"import horovod, {module} as h\n"
            f"assert horovod.__version__ == {HVD_VERSION!r}, 'version ' + horovod.__version__\n"
            "assert h.gloo_built(), 'built without Gloo'\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **PROBE_ENV},
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return f"importing {module} took over 3 minutes"
    if done.returncode == 0:
        return None
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit status {done.returncode}"
    return f"Horovod's {framework} extension does not load ({last[:200]})"


def _probe_record() -> str:
    return os.path.join(os.path.expanduser(settings.CACHE.get()), "horovod-probe.json")


def _fingerprint(framework: str) -> str | None:
    """What a passed probe of ``framework`` depended on: this interpreter, Horovod's package and
    its extension for the framework, the framework's package (each file by size and modification
    time: a rebuild or a reinstall changes them) and the library path. None when one of them
    cannot be found (then nothing is recorded, and every launch probes)."""
    hvd, fw = importlib.util.find_spec("horovod"), importlib.util.find_spec(framework)
    if hvd is None or not hvd.submodule_search_locations or fw is None or not fw.origin:
        return None
    root = hvd.submodule_search_locations[0]
    files = [os.path.join(root, "__init__.py"), fw.origin, *sorted(glob.glob(os.path.join(root, framework, "*.so")))]
    parts = [sys.executable, HVD_VERSION, os.environ.get("LD_LIBRARY_PATH", "")]
    try:
        for path in files:
            st = os.stat(path)
            parts.append(f"{path} {st.st_size} {st.st_mtime_ns}")
    except OSError:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _probed() -> dict:
    """The recorded fingerprints of passed probes, by framework (none when unreadable)."""
    try:
        with open(_probe_record(), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


_RECORDING = threading.Lock()  # `launcher doctor` probes the frameworks in threads


def _record(framework: str, fingerprint: str) -> None:
    """Add a passed probe to the record, atomically; a cache that cannot be written is skipped."""
    path = _probe_record()
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _RECORDING:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({**_probed(), framework: fingerprint}, f)
            os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def build_hint() -> str:
    return BUILD_HINT.format(python=sys.executable)


INSTALL_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "scripts", "install-horovod")
BUILD_LOG = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "launcher", "logs", "horovod-build.log")  # where scripts/install-horovod logs
PROGRESS_S = 30.0


def build_on_first_use(framework: str, note) -> None:
    """Build Horovod now if a run asks for it and it was never built.

    `scripts/run` sets up without Horovod (a several-minute build a first run does
    not need); the first `--backend horovod` run builds it here with the project's
    install script, saying why and how far it is, once: the wheel is cached.
    Does nothing when Horovod is installed (usable or not: then the run is refused
    with the reason) or when the install script is not at hand (an installed copy).
    """
    # installed(), not probe(): an installed Horovod is probed by the availability check, outside
    # the set-up the driver times (launcher.driver.startup.setup_phase) and leaves out of the run.
    if framework not in EXTENSIONS or installed() or not os.access(INSTALL_SCRIPT, os.X_OK):
        return
    _deferred.require("horovod", "--backend horovod (its build, with TensorFlow's extension)")
    note(f"--backend horovod: Horovod {HVD_VERSION} is not installed in this environment yet; installing it "
         f"now, once (a build takes about 8 minutes on 2 idle cores, a cached wheel seconds; log: {BUILD_LOG})")
    started = time.time()
    proc = subprocess.Popen([INSTALL_SCRIPT, sys.executable], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            proc.wait(timeout=PROGRESS_S)
        except subprocess.TimeoutExpired:
            note(f"building Horovod: {time.time() - started:.0f}s so far ({_last_line(BUILD_LOG)})")
    reader.join(timeout=5)
    probe.cache_clear()
    if proc.returncode == 0:
        note(f"Horovod {HVD_VERSION} installed in {time.time() - started:.0f}s")
    else:
        note(f"building Horovod failed: {(lines[-1].strip() if lines else 'see the log')[:300]}")


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            tail = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return tail[-1][:120] if tail else "log empty so far"
    except OSError:
        return "no log yet"


class HorovodBackend(Backend):
    name = "horovod"
    description = "Horovod ring-allreduce over Gloo (torch: DistributedOptimizer; TF: DistributedGradientTape)"
    frameworks = ("torch", "tensorflow")

    def unavailable_reason(self, framework: str) -> str | None:
        if framework not in EXTENSIONS:
            return f"Horovod has no {framework} support here (it supports {', '.join(EXTENSIONS)})"
        why = probe(framework)
        return f"{why}; {build_hint()}" if why else None

    def forget_checks(self) -> None:
        try:  # this process's own answers (functools' cache) stand: it probed them itself
            os.unlink(_probe_record())
        except OSError:
            pass

    def prepare(self, framework: str, note) -> None:
        build_on_first_use(framework, note)

    def config(self, spec):
        from launcher.backends.horovod_train import HorovodConfig

        mb = getattr(spec, "hvd_fusion_mb", None)
        return HorovodConfig(fusion_threshold_bytes=None if mb is None else int(mb * 1024 * 1024))

    def trainer(self, spec, train_fn, loop_config, scaling_config, run_config):
        from launcher.backends import raytrain

        return raytrain.trainer(train_fn, loop_config, self.config(spec), scaling_config, run_config)

    runs_scripts = True

    def script_env(self, framework: str) -> dict[str, str]:
        # HorovodRayBackend.on_start already put the ring variables in this worker's environment.
        env = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
        return {**env, **frameworks.get(framework).horovod_env()}

    def torch_comm(self, spec=None) -> TorchComm:
        if spec is None:
            return HorovodComm()
        return HorovodComm(fp16=spec.hvd_fp16, backward_passes=spec.accumulation)

    def tf_comm(self, spec=None) -> TFComm:
        return HorovodTFComm(fp16=bool(spec and spec.hvd_fp16))


# -- worker side -------------------------------------------------------------------------

class _HorovodRing:
    """What both frameworks' comms share: Horovod's module for the framework, init, rank and size."""

    MODULE = ""
    _hvd = None

    @property
    def hvd(self):
        if self._hvd is None:
            self._hvd = importlib.import_module(self.MODULE)
        return self._hvd

    def setup(self) -> None:
        self.hvd.init()

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def world_size(self) -> int:
        return self.hvd.size()


class HorovodComm(_HorovodRing, TorchComm):
    """horovod.torch in a worker whose HOROVOD_* environment the backend has set."""

    MODULE = EXTENSIONS["torch"]

    def __init__(self, fp16: bool = False, backward_passes: int = 1) -> None:
        self.fp16, self.backward_passes = fp16, backward_passes

    def device(self):
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", self.hvd.local_rank())
        return torch.device("cpu")

    def wrap_optimizer(self, optimizer, model):
        hvd = self.hvd
        compression = hvd.Compression.fp16 if self.fp16 else hvd.Compression.none
        restored = optimizer.state_dict()
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                           compression=compression,
                                           backward_passes_per_step=self.backward_passes, op=hvd.Average)
        # The wrapper is a new optimizer built from the param groups, with empty state:
        # carry over what a restored checkpoint put into the original.
        if restored["state"]:
            wrapped.load_state_dict(restored)
        _accept_set_to_none(wrapped)
        return wrapped

    def clip_gradients(self, parameters, optimizer, max_norm: float):
        """Wait for Horovod's allreduce first (it runs in the background during backward), then
        clip the averaged gradients. ``optimizer.step()`` then reduces them once more: the average
        of equal values is the same values, at the cost of one allreduce more per step (Horovod's
        skip_synchronize would avoid it, but it must wrap the user's own ``step()`` call)."""
        import torch

        optimizer.synchronize()
        warnings.filterwarnings("ignore", message=r"optimizer\.step\(\) called without optimizer\.skip_synchronize")
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def after_restore(self, model, optimizer) -> None:
        """Make every rank start from rank 0's parameters and optimizer state."""
        import torch

        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod fills an empty optimizer state by stepping once with zero gradients,
        # which would advance Adam's step count on a fresh run; a fresh optimizer is
        # the same on every rank, so only broadcast state that some rank has.
        has_state = torch.tensor([1.0 if optimizer.state_dict()["state"] else 0.0])
        if hvd.allreduce(has_state, op=hvd.Sum, name="launcher.has_optimizer_state").item() > 0:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def allreduce_sum(self, tensor):
        if self.world_size == 1:
            return tensor
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def allreduce_sum_(self, tensor):
        """In place, as DistributedOptimizer reduces gradients (no new tensor per call)."""
        if self.world_size > 1:
            self.hvd.allreduce_(tensor, op=self.hvd.Sum)
        return tensor


def _accept_set_to_none(optimizer) -> None:
    """Horovod's ``zero_grad()`` takes no argument, while torch's takes ``set_to_none`` and loops
    written for torch pass it: the wrapped optimizer accepts it too."""
    import torch

    horovods = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        if set_to_none:
            horovods()  # Horovod's checks, then torch's default (set_to_none=True)
        else:
            torch.optim.Optimizer.zero_grad(optimizer, set_to_none=False)

    optimizer.zero_grad = zero_grad


class HorovodTFComm(_HorovodRing, TFComm):
    """horovod.tensorflow in a worker whose HOROVOD_* environment the backend has set.

    Each step averages the gradients over the ring with hvd.DistributedGradientTape, so
    the update follows the mean loss of the global batch, like DDP and the mirrored strategy.
    """

    MODULE = EXTENSIONS["tensorflow"]

    def __init__(self, fp16: bool = False) -> None:
        self.fp16 = fp16

    def train_step(self, model, optimizer, loss):
        import tensorflow as tf

        hvd = self.hvd
        compression = hvd.Compression.fp16 if self.fp16 else hvd.Compression.none

        @tf.function(reduce_retracing=True)
        def step(x, y):
            with tf.GradientTape() as tape:
                mean = tf.reduce_mean(loss(y, model(x, training=True)))
            tape = hvd.DistributedGradientTape(tape, compression=compression, op=hvd.Average)
            grads = tape.gradient(mean, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return mean

        return step

    wraps_keras_optimizer = True

    def keras_optimizer(self, optimizer):
        """Horovod's Keras DistributedOptimizer: it averages the gradients ``minimize`` computes
        (what ``model.fit`` calls) over the ring."""
        hvd_keras = importlib.import_module(self.MODULE + ".keras")
        compression = self.hvd.Compression.fp16 if self.fp16 else self.hvd.Compression.none
        return hvd_keras.DistributedOptimizer(optimizer, compression=compression)

    def is_wrapped(self, optimizer) -> bool:
        return hasattr(optimizer, "_allreduce_grads")

    def after_restore(self, model, optimizer) -> None:
        """Every rank starts from rank 0's variables, model and optimizer."""
        self.hvd.broadcast_variables(model.variables, root_rank=0)
        if optimizer is not None:
            variables = optimizer.variables
            self.hvd.broadcast_variables(variables() if callable(variables) else variables, root_rank=0)

    def allreduce_sum(self, values):
        import tensorflow as tf

        if self.world_size == 1:
            return values
        return self.hvd.allreduce(tf.constant(values), op=self.hvd.Sum).numpy()
