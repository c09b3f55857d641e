"""The layout holds: no import cycles, imports point one way, every private Ray name still exists.

The cycle check reads every ``import`` of the product, module level and
inside functions alike (an import inside a function hides a cycle from the
interpreter, not from a reader), and fails on any cycle between modules or
between packages. Then each module is imported alone in a fresh
interpreter, as a user or a Ray worker would first import it.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("launcher", "workloads", "cluster", "benchmarks")
# What benchmarks/ may import from: the packages' public exports (their __all__).
PUBLIC = ("launcher", "launcher.backends", "launcher.driver", "launcher.worker", "launcher.storage",
          "launcher.lab", "launcher.preemption", "launcher.predict")


def product_modules() -> dict[str, str]:
    """module name -> file, for every Python file of the product."""
    found = {}
    for top in PRODUCT:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


MODULES = product_modules()


def imports_of(module: str) -> set[str]:
    """The product modules ``module`` imports, anywhere in its file."""
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """launcher.driver.launch -> launcher.driver; top-level modules (launcher.spec) stand alone."""
    parts = module.split(".")
    if parts[0] == "launcher" and len(parts) >= 2 and os.path.isdir(os.path.join(ROOT, "launcher", parts[1])):
        return ".".join(parts[:2])
    return module if parts[0] == "launcher" else parts[0]


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    assert cycles(GRAPH) == []


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        here = package_of(module)
        packages.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
    assert cycles(packages) == []


def test_imports_point_one_way():
    for module, targets in GRAPH.items():
        if not module.startswith("launcher.cli") and module != "launcher.__main__":
            assert not [t for t in targets if t.startswith("launcher.cli")], f"{module} imports the CLI"
        if module.startswith("launcher.cli.") and module != "launcher.cli.main":
            assert "launcher.cli.main" not in targets, f"{module} imports launcher.cli.main"
        if module.startswith("workloads"):
            assert all(t.startswith("workloads") for t in targets), f"{module} imports {targets}"
        if module.startswith("cluster"):
            assert not [t for t in targets if t.startswith("workloads")], f"{module} imports a workload"


def test_benchmarks_use_only_the_public_api():
    for module in (m for m in MODULES if m.startswith("benchmarks")):
        tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("launcher.")], \
                    f"{module}: import the public packages' names, not {[a.name for a in node.names]}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "launcher":
                assert node.module in PUBLIC, f"{module}: `from {node.module} import ...` is not public"
                exported = set(importlib.import_module(node.module).__all__)
                for alias in node.names:
                    ok = alias.name in exported or f"{node.module}.{alias.name}" in PUBLIC
                    assert ok, f"{module}: {node.module}.{alias.name} is not in its package's __all__"


def test_public_exports_resolve():
    for package in PUBLIC:
        mod = importlib.import_module(package)
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{package}.{name}"


def _import_alone(module: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = done.stderr.strip().splitlines()
    return module, "" if done.returncode == 0 else (lines[-1] if lines else f"exit {done.returncode}")


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # launcher.__main__ runs the CLI; the rest must import cleanly, whatever was imported before.
    modules = sorted(m for m in MODULES if m != "launcher.__main__")
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = {m: why for m, why in pool.map(_import_alone, modules) if why}
    assert failed == {}


def test_cli_imports_no_framework_ray_train_or_google_cloud():
    probe = ("import sys, launcher.cli.main\n"
             "heavy = ('torch', 'tensorflow', 'ray.train', 'google.cloud', 'horovod')\n"
             "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(__import__("launcher._ray", fromlist=["PRIVATE"]).PRIVATE))
def test_every_private_ray_name_still_exists(name):
    from launcher import _ray

    assert _ray.resolve(name) is not None


def test_every_overridden_ray_method_still_exists():
    from launcher import _ray

    for target in _ray.OVERRIDDEN:
        module, _, attribute = target.partition(":")
        owner, method = attribute.split(".")
        assert callable(getattr(getattr(importlib.import_module(module), owner), method)), target


def test_the_job_config_variable_is_rays():
    from launcher import _ray

    constants = importlib.import_module("ray._private.runtime_env.constants")
    assert constants.RAY_JOB_CONFIG_JSON_ENV_VAR == _ray.JOB_CONFIG_ENV


def test_rays_checkpoint_list_is_where_and_as_the_launcher_reads_it():
    from launcher import _ray

    constants = importlib.import_module("ray.train.v2._internal.constants")
    assert constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME == _ray.CHECKPOINT_SNAPSHOT
    manager = importlib.import_module("ray.train.v2._internal.execution.checkpoint.checkpoint_manager")
    named = manager._TrainingResultState(checkpoint_dir_name="checkpoint_b", metrics={"loss": 1.0})
    state = manager._CheckpointManagerState(
        checkpoint_results=[named], checkpoint_report_indices=[0], latest_checkpoint_result=named,
        pending_training_results=[], pending_validation_specs=[], current_report_index=1,
        validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[])
    assert _ray.snapshot_names(state.json(), ["checkpoint_a", "checkpoint_b"]) == ["checkpoint_b"]


def ray_internals_used(path: str) -> list[str]:
    """What a file uses of Ray that is not public API: imports of private modules (a name part
    starting with ``_``), Ray's dashboard modules, Ray Client's module, generated protobufs;
    attributes starting with ``_`` of ``ray...``; internal resource names; such module names
    handed to importlib as strings."""
    found = []

    def private(module: str) -> bool:
        parts = module.split(".")
        return parts[0] == "ray" and (any(p.startswith("_") for p in parts)
                                      or module.startswith(("ray.dashboard", "ray.util.client", "ray.core.generated")))

    def rooted_at_ray(node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id == "ray"

    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and private(node.module or ""):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and rooted_at_ray(node.value):
            found.append(f"ray...{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "__internal_head__" in node.value or private(node.value.split(":")[0].strip())):
            found.append(repr(node.value))
    return found


def test_ray_internals_are_used_only_through_launcher_ray():
    """Everything of Ray's that is not public API goes through launcher/_ray.py, where each
    name is listed with why it is used and checked against the installed Ray below."""
    used = {m: ray_internals_used(p) for m, p in MODULES.items() if m != "launcher._ray"}
    assert {m: u for m, u in used.items() if u} == {}


def test_the_scan_for_ray_internals_can_fail(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import ray._private.services\nfrom ray.dashboard.modules import job\nimport ray\n"
                      "x = ray._private.worker\nr = {'node:__internal_head__': 1}\n"
                      "import importlib\nimportlib.import_module('ray.train.v2._internal.constants')\n"
                      "from ray.train import report\n")
    assert ray_internals_used(str(sample)) == [
        "import ray._private.services", "from ray.dashboard.modules import ...", "ray..._private",
        "'node:__internal_head__'", "'ray.train.v2._internal.constants'"]


def test_rays_head_resource_and_job_client_modules_still_exist():
    from launcher import _ray

    constants = importlib.import_module("ray._common.constants")
    assert constants.HEAD_NODE_RESOURCE_NAME == _ray.HEAD_RESOURCE
    _ray.quiet_job_client()  # imports Ray's job client modules: fails here if they moved
    assert _ray.client_connected() is False
