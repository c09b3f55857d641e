"""`launcher doctor`: one line per framework and backend, usable or why not and how to fix."""

from __future__ import annotations

import importlib.util
import json

from launcher.cli.main import main
from launcher.cli.doctor import Check, backend_check


def test_doctor_reports_every_framework_and_backend(capsys):
    assert main(["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert {"torch", "tensorflow", "native/torch", "horovod/torch", "horovod/tensorflow"} <= set(checks)
    assert checks["torch"]["usable"] and checks["torch"]["detail"].startswith("torch 2.")
    assert checks["native/torch"]["usable"]
    assert checks["xgboost"]["detail"].startswith("xgboost 3.") and checks["native/xgboost"]["usable"]
    assert checks["scikit-learn"]["usable"] and checks["scikit-learn"]["detail"].startswith("scikit-learn 1.")
    if importlib.util.find_spec("horovod") is None:
        assert not checks["horovod/torch"]["usable"]
        assert "scripts/install-horovod" in checks["horovod/torch"]["detail"]
    else:
        assert checks["horovod/torch"]["usable"], checks["horovod/torch"]
        assert checks["horovod/tensorflow"]["usable"], checks["horovod/tensorflow"]
    for c in checks.values():
        assert c["usable"] or c["detail"], c  # every unusable line says why


def test_doctor_text_is_one_line_per_check(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 6
    assert any(line.split()[:3] == ["backend", "native/torch", "usable:"] for line in lines)


def test_backend_needs_its_framework():
    from launcher import backends

    native = backends.get("native")
    check = backend_check(native, "torch", (False, "torch does not import (boom); run scripts/setup-env"))
    assert check == Check("backend", "native/torch", False, "needs torch: torch does not import (boom); "
                                                           "run scripts/setup-env")
