"""Instances checked: sent as numbers, or by the model's input or feature names.

A model with one input takes each instance by that input's name too (``{"x": [...]}``:
the name the V2 metadata gives an unnamed input), and a booster or estimator whose
features have names, one object of them per row, as Vertex AI's prebuilt containers take
named inputs (:func:`by_name`). Anything else that is not a number is named in the
ValueError (:func:`checked`, :func:`numeric`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

INPUT = "x"  # the name a model with one unnamed input has in the V2 metadata (launcher.predict.protocols)


def by_name(instances: Any, features: list[str] | None = None) -> Any:
    """Instances sent as objects keyed by the model's input, as Vertex AI's prebuilt containers
    take them: ``{"x": value}`` (the name ``GET /v2/models/NAME`` gives a model's one input) or,
    where the model's features have names (a booster or an estimator fitted on a table), one
    ``{feature: number, ...}`` per row. Returns the instances as the plain values the format
    reads; anything that is not an object passes as it is.

    Raises:
        ValueError: an object that is neither: the line names its keys and the accepted forms.
    """
    if not isinstance(instances, list) or not any(isinstance(i, dict) for i in instances):
        return instances
    out = []
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            out.append(instance)
        elif set(instance) == {INPUT}:
            out.append(instance[INPUT])
        elif features and set(instance) == set(features):
            out.append([instance[f] for f in features])
        else:
            keys = ", ".join(f'"{k}"' for k in list(instance)[:5]) or "no keys"
            raise ValueError(f"instances[{i}] is an object with {keys}: {accepted_forms(features)}")
    return out


def accepted_forms(features: list[str] | None = None) -> str:
    """What the 400 of a model without named inputs lists: the instance forms it takes."""
    forms = f'send each instance as its numbers ([...]), or as {{"{INPUT}": [...]}}'
    if features:
        shown = ", ".join(f'"{f}": ...' for f in features[:3]) + (", ..." if len(features) > 3 else "")
        forms += f" or {{{shown}}} by its {len(features)} features' names"
    return forms


def _not_a_number(instances: list) -> str | None:
    """Which element of ``instances`` is neither a number nor a list, said in one line (None
    when all are). Strings are left to the workload's own check, which names the type."""
    stack: list[tuple[str, Any]] = [(f"instances[{i}]", v) for i, v in reversed(list(enumerate(instances)))]
    while stack:
        where, value = stack.pop()
        if value is None or isinstance(value, (dict, bool)):
            kind = "null" if value is None else ("an object" if isinstance(value, dict) else "true/false")
            return f"{where} is {kind}, not a number"
        if isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def checked(instances: Any) -> np.ndarray:
    """Instances that should be numbers as one array; ValueError naming the first element that
    is not one (null, an object, true/false). Text is left to the format's own check."""
    array = as_array(instances)
    if array.dtype.kind not in "iuf" and isinstance(instances, list):
        odd = _not_a_number(instances)  # walked only when not all numbers
        if odd:
            raise ValueError(odd)
    return array


def as_array(instances: Any) -> np.ndarray:
    """The instances as one array; ragged lists become an object array (refused later)."""
    try:
        return np.asarray(instances)
    except ValueError:
        return np.asarray(instances, dtype=object)

def numeric(instances: Any, width: int | None, what: str) -> np.ndarray:
    """Instances of ``width`` numbers each (a tabular model's rows) as a float32 batch."""
    x = np.asarray(instances)
    if x.dtype.kind not in "iufb":
        if x.dtype == object:
            raise ValueError("instances must be rows of the same length, of numbers")
        raise ValueError(f"instances must be numbers, got {'text' if x.dtype.kind in 'US' else x.dtype}")
    if x.ndim == 1 and width == 1:
        x = x[:, None]  # a one-feature model's instances, each a number
    if x.ndim != 2 or (width is not None and x.shape[1] != width):
        shape = "x".join(map(str, x.shape[1:])) or "a single number"
        raise ValueError(f"each instance must be {width if width is not None else 'a row of'} numbers ({what}), "
                         f"got {shape}")
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("instances hold NaN or infinity")
    return x

