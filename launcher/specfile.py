"""Reading a job spec from YAML (``launcher run --config job.yaml``).

The file is a flat mapping whose keys are JobSpec fields (``workers: 4``,
``batch_size: 64``, ``params: {image_size: 64}``). Any other key is an error
naming it, with the closest valid key.
"""

from __future__ import annotations

from launcher.errors import UserError
from launcher.spec import JobSpec


def load_spec_file(path: str) -> JobSpec:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path} does not exist", "pass the path of a job spec YAML file") from None
    except OSError as exc:
        raise UserError(f"cannot read --config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{path}: {problem}{where}", "fix the YAML syntax") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of spec keys (workload: ..., workers: ...), "
                        f"got a {type(raw).__name__}")
    return JobSpec.from_mapping(raw, source=path)
