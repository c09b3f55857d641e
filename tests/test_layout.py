"""The layout holds: no import cycles, imports point one way, headers list what modules import,
every private Ray name still exists.

The cycle check reads every ``import`` of the product, module level and
inside functions alike (an import inside a function hides a cycle from the
interpreter, not from a reader), and fails on any cycle between modules or
between packages. Then each module is imported alone in a fresh
interpreter, as a user or a Ray worker would first import it. An import
inside a function must defer something heavy (the rule and its exceptions are
in ``launcher/_deferred.py``); every other import belongs in the module's header.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import subprocess
import sys

import pytest

from launcher._deferred import EXCEPTIONS, STARTUP, is_heavy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("launcher", "workloads", "cluster", "benchmarks")
# What benchmarks/ may import from: the packages' public exports (their __all__).
PUBLIC = ("launcher", "launcher.backends", "launcher.driver", "launcher.worker", "launcher.storage",
          "launcher.lab", "launcher.preemption", "launcher.predict", "launcher.data")


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


@functools.lru_cache(maxsize=None)
def lazy_table(package: str) -> dict[str, str]:
    """name -> module for a package's lazy exports (``lazy_exports(__name__, {...})`` in its ``__init__``)."""
    path = MODULES.get(package, "")
    if not path.endswith("__init__.py"):
        return {}
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Dict)):
            return {k.value: v.value for k, v in zip(node.args[1].keys, node.args[1].values)}
    return {}


def imported_by(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules an import statement imports (a lazy export counts as the module it names)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    out = []
    for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:
            out.append(f"{base}.{alias.name}")
        elif base.split(".")[0] in PRODUCT:
            out.append(lazy_table(base).get(alias.name, base))
        else:  # a library's name or submodule: `from importlib import metadata` imports importlib.metadata
            out.append(f"{base}.{alias.name}")
    return out


def module_imports(module: str, path: str) -> tuple[set[str], list[tuple[int, str, list[str]]]]:
    """(the modules ``module`` imports at module level, with the packages above them;
    ``(line, function, modules)`` for each import inside a function)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    top: set[str] = set()
    inside: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name], in_function or not isinstance(child, ast.ClassDef))
            elif isinstance(child, ast.Lambda):
                visit(child, scope + ["<lambda>"], True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                names = imported_by(child, package)
                if in_function:
                    inside.append((child.lineno, ".".join(scope), names))
                else:
                    for name in names:  # importing a.b.c imports a and a.b first
                        parts = name.split(".")
                        top.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            else:
                visit(child, scope, in_function)

    visit(ast.parse(open(path, encoding="utf-8").read()), [], False)
    return top, inside


def heavy_modules(top: dict[str, set[str]]) -> set[str]:
    """The project modules whose import imports a heavy library: at their own module level,
    through other project modules' module-level imports, or through the packages above them
    (importing workloads.registry runs workloads/__init__.py first)."""
    heavy: set[str] = set()
    grew = True
    while grew:
        grew = False
        for module, names in top.items():
            above = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
            if module not in heavy and any(is_heavy(n) or n in heavy for n in names | above):
                heavy.add(module)
                grew = True
    return heavy


def loaded_by(entry: str, top: dict[str, set[str]]) -> set[str]:
    """The project modules importing ``entry`` imports: its module-level imports, followed."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in seen or module not in top:
            continue
        seen.add(module)
        todo.extend(top[module] | {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)})
    return seen


TOP = {m: module_imports(m, path)[0] for m, path in MODULES.items()}
HEAVY_MODULES = heavy_modules(TOP)
LOADED_AT_START = {package: loaded_by(entry, TOP) for package, entry in STARTUP.items()}


def may_wait(module: str, function: str, name: str) -> bool:
    """Whether ``module``'s ``function`` may import ``name`` inside itself (the rule in launcher/_deferred.py)."""
    if is_heavy(name) or name in HEAVY_MODULES:  # (a), (b)
        return True
    if f"{module}:{function}" in EXCEPTIONS:  # (c)
        return True
    return name in MODULES and any(module.startswith(package + ".") and name not in LOADED_AT_START[package]
                                   for package in STARTUP)  # (d)


def misplaced_imports(module: str, path: str) -> list[str]:
    """``file:line function: modules`` for each import inside a function that the rule does not allow
    (every module a statement imports must be allowed)."""
    found = []
    for line, function, names in module_imports(module, path)[1]:
        wrong = [n for n in names if not may_wait(module, function, n)]
        if wrong:
            found.append(f"{os.path.relpath(path, ROOT)}:{line} {function}: {', '.join(wrong)}")
    return found


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


def test_imports_inside_functions_defer_something_heavy():
    # The rule and its exceptions: launcher/_deferred.py. Anything else goes in the module's header.
    found = [line for module, path in sorted(MODULES.items()) for line in misplaced_imports(module, path)]
    assert found == [], "imports inside functions that defer nothing heavy (move them to the top, or see " \
                        "launcher/_deferred.py):\n" + "\n".join(found)


def test_the_deferred_import_check_reports_what_it_should(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("\n".join([
        "import os",                                    # 1: module level
        "def cheap():",
        "    import json",                              # 3: stdlib: reported
        "def heavy():",
        "    import torch",                             # 5: a heavy library
        "    from ray import train",                    # 6: all of ray.*
        "    from launcher.driver import launch",       # 7: a project module that imports Ray at its top
        "class Mixed:",
        "    def method(self):",
        "        from launcher.driver import launch, startup",  # 10: startup is cheap: reported
        "",
    ]))
    assert "launcher.driver.launch" in HEAVY_MODULES and "launcher.driver.startup" not in HEAVY_MODULES
    where = os.path.relpath(path, ROOT)
    assert misplaced_imports("sample", str(path)) == [f"{where}:3 cheap: json",
                                                      f"{where}:10 Mixed.method: launcher.driver.startup"]
    # (d): a command module may defer a project module the CLI's start-up does not load, not one it does.
    assert "launcher.driver.jobs" not in LOADED_AT_START["launcher.cli"]
    assert may_wait("launcher.cli.jobs", "cmd_submit", "launcher.driver.jobs")
    assert not may_wait("launcher.cli.jobs", "cmd_submit", "launcher.errors")
    assert not may_wait("launcher.driver.script", "run_program", "launcher.driver.jobs")


def test_every_exception_to_the_rule_is_still_needed():
    inside = {f"{m}:{function}": names for m, path in MODULES.items()
              for _, function, names in module_imports(m, path)[1]}
    for key in EXCEPTIONS:
        module, _, function = key.partition(":")
        assert key in inside, f"{key}: no import inside that function any more; drop it from EXCEPTIONS"
        heavy_anyway = [n for n in inside[key] if is_heavy(n) or n in HEAVY_MODULES]
        assert heavy_anyway != inside[key], f"{key}: imports only heavy modules; drop it from EXCEPTIONS"


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


def test_the_lab_is_a_layer_only_commands_and_benchmarks_use():
    # launcher/lab/ stands in for the cloud (`launcher cluster rehearse`, `launcher preemption demo`, the
    # Cloud Storage emulator, `launcher bench preemption`): no run, tuning or prediction reaches it.
    users = {m for m, targets in GRAPH.items()
             if not m.startswith("launcher.lab") and any(t.startswith("launcher.lab") for t in targets)}
    assert users and not [m for m in users if not m.startswith(("launcher.cli.", "benchmarks."))], users


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


# Each module imported alone: in a child forked from one fresh interpreter that has imported only
# Ray and NumPy (third-party packages most modules import, so no module of ours is there first), two
# children at a time. An interpreter of its own per module took 27 s in the suite; this ~10 s.
IMPORT_ALONE = """
import importlib, json, os, sys, traceback
import numpy, ray
assert not [m for m in sys.modules if m.split(".")[0] in ("launcher", "workloads", "cluster", "benchmarks")]
modules, running, failed = json.loads(sys.argv[1]), {}, {}

def reap():
    pid, status = os.wait()
    module, read = running.pop(pid)
    why = os.read(read, 4096).decode(errors="replace").strip()
    os.close(read)
    if status:
        failed[module] = why or f"exit status {status}"

for module in modules:
    while len(running) >= 2:
        reap()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    running[pid] = (module, read)
while running:
    reap()
print(json.dumps(failed))
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # launcher.__main__ runs the CLI; the rest must import cleanly, whatever was imported before.
    modules = sorted(m for m in MODULES if m != "launcher.__main__")
    done = subprocess.run([sys.executable, "-c", IMPORT_ALONE, json.dumps(modules)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


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
