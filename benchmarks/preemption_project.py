"""``launcher bench preemption --project``: what preemptions would cost at 64-1,024 GPUs, per strategy.

A model, not a measurement. Spot nodes of ``gpus_per_node`` GPUs are preempted (with notice)
at ``rate`` per node-hour, so a group of n GPUs sees ``rate * n / gpus_per_node`` preemptions an
hour. Each costs the group, in seconds of the whole group's time:

* a whole-group restart ``R(n) = restart_fixed_s + NCCL init(n) + TCPStore(n) + reload_s``:
  the measured part (on this machine: the new group's processes, our set-up, the first step),
  NCCL initialisation and the store's rendezvous, each growing linearly with the ranks through a
  published figure at a published scale, and the checkpoint's reload (assumed constant: each
  host reads its own shard);
* ``wait``: held before the drain deadline, the replacement's boot, one restart;
* ``elastic``: held, a restart to shrink, the boot at (n - gpus_per_node)/n of the pace, a
  restart to grow; ``elastic-early``: the same, the boot shortened by the notice;
* ``ft`` (a quorum per step, a replica group per node): two quorum changes (the leave and the
  join), each ``quorum_change_s`` plus re-initialising the process group among the replica
  groups (NCCL init's per-rank time x the groups), and the boot at the smaller pace; and on
  every step, whether anything is preempted or not, the quorum's own share of the step
  (``quorum_overhead``).

Goodput = (1 - the preemptions' cost per hour / 3,600 s) x (1 - the per-step overhead).
Not modelled: preemptions without notice (the process-group timeout, steps since the last
checkpoint redone), bursts of preemptions (several nodes at once), stockouts, stragglers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from benchmarks import project, results

GPUS = (64, 128, 256, 512, 1024)
STRATEGIES = ("wait", "elastic", "elastic-early", "ft")


@dataclass(frozen=True)
class Inputs:
    """The model's inputs; each default's source is in :data:`SOURCES`."""

    rates_per_node_h: tuple[float, ...] = (0.002, 0.007)
    gpus_per_node: int = project.Model().gpus_per_node
    notice_s: float = 30.0
    boot_s: float = 90.0
    held_s: float = 5.2
    restart_fixed_s: float = 6.8
    nccl_init_s: float = 150.0
    nccl_init_ranks: int = 16384
    store_s: float = 100.0
    store_ranks: int = 96 * 1024
    reload_s: float = 60.0
    quorum_change_s: float = 0.2
    quorum_overhead: float = 0.01
    measured: dict = field(default_factory=dict)  # what a bench result replaced, and from where


SOURCES = {
    "rates_per_node_h": "Google's preemptible docs: 5-15 % per day per project on a 7-day average "
                        "(about 0.002-0.007 per VM-hour; all machine types, not GPUs alone)",
    "gpus_per_node": "an 8-GPU VM (a3-highgpu-8g, a2-highgpu-8g)",
    "notice_s": "GCE's preemption notice",
    "boot_s": "`bench preemption`'s default replacement boot (an estimate, see the preemption guide)",
    "held_s": "measured: the group held before the drain deadline (docs/results/preemption.md, long epochs)",
    "restart_fixed_s": "measured: node removed -> the new group's function 3.1 s, set-up 1.7 s, first step 2.0 s",
    "nccl_init_s": "NCCL init '2.5-minute ... at large scale' (NVIDIA/nccl #1156); the scale is assumed to be "
                   "nccl_init_ranks, and the time linear in the ranks",
    "store_s": "TCPStore at 96K ranks: 100 s with libuv (PyTorch's TCPStore tutorial); linear in the ranks",
    "reload_s": "assumed: a checkpoint restored from Cloud Storage, each host its shard (not measured)",
    "quorum_change_s": "measured: torchft, 3 replica groups on this machine, a leave cost the survivors' "
                       "step 0.16-0.24 s (issue 61); PyTorch's Fault Tolerant Llama: gloo re-init < 1 s",
    "quorum_overhead": "assumed: the quorum's share of every step (torchft forms it while the forward runs)",
}


def nccl_init(n: int, inputs: Inputs) -> float:
    return inputs.nccl_init_s * n / inputs.nccl_init_ranks


def restart_s(n: int, inputs: Inputs) -> float:
    """One whole-group restart of n GPUs, in seconds."""
    return inputs.restart_fixed_s + nccl_init(n, inputs) + inputs.store_s * n / inputs.store_ranks + inputs.reload_s


def quorum_change(n: int, inputs: Inputs) -> float:
    """One quorum change among n / gpus_per_node replica groups: the quorum, and the process group
    among the groups initialised again."""
    return inputs.quorum_change_s + nccl_init(max(1, n // inputs.gpus_per_node), inputs)


def cost_s(strategy: str, n: int, inputs: Inputs) -> float:
    """Seconds of the whole group's time one preemption costs."""
    smaller = inputs.gpus_per_node / n  # the share of the pace the missing node took with it
    if strategy == "wait":
        return inputs.held_s + inputs.boot_s + restart_s(n, inputs)
    if strategy in ("elastic", "elastic-early"):
        boot = max(0.0, inputs.boot_s - inputs.notice_s) if strategy == "elastic-early" else inputs.boot_s
        return inputs.held_s + 2 * restart_s(n, inputs) + smaller * boot
    if strategy == "ft":
        return 2 * quorum_change(n, inputs) + smaller * inputs.boot_s
    raise ValueError(f"unknown strategy {strategy!r}")


def goodput(strategy: str, n: int, rate: float, inputs: Inputs) -> float:
    per_hour = rate * n / inputs.gpus_per_node * cost_s(strategy, n, inputs)
    overhead = inputs.quorum_overhead if strategy == "ft" else 0.0
    return max(0.0, 1.0 - per_hour / 3600.0) * (1.0 - overhead)


def project_rows(inputs: Inputs, gpus=GPUS, strategies=STRATEGIES) -> list[dict]:
    return [{"strategy": s, "gpus": n, "rate_per_node_h": rate,
             "preemptions_per_h": round(rate * n / inputs.gpus_per_node, 4),
             "restart_s": round(restart_s(n, inputs), 2), "quorum_change_s": round(quorum_change(n, inputs), 3),
             "cost_per_preemption_s": round(cost_s(s, n, inputs), 2), "goodput": round(goodput(s, n, rate, inputs), 5)}
            for rate in inputs.rates_per_node_h for s in strategies for n in gpus]


def from_bench(path: str, inputs: Inputs = Inputs()) -> Inputs:
    """``inputs`` with what a `bench preemption` preemption.json measured: the hold and the restart's
    parts (mean over the restarting strategies), the boot and notice it ran with, ft's quorum
    changes, and ft's pace against a restarting strategy's at full size (its per-step overhead)."""
    with open(path) as f:
        data = json.load(f)
    runs = data.get("strategies") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path} holds no strategies (is it a `launcher bench preemption` preemption.json?)")
    got: dict = {}
    settings = data.get("settings") or {}
    if settings.get("boot_s") is not None:
        got["boot_s"] = float(settings["boot_s"])
    if settings.get("notice_s"):
        got["notice_s"] = float(settings["notice_s"])
    parts = [r.get("breakdown_s") or {} for r in runs if not r.get("ft")]
    held = [p["held before the deadline"] for p in parts if "held before the deadline" in p]
    steps = ("removed -> train function starts", "worker set-up (data, model, restore)", "-> first step")
    fixed = [sum(p[k] for k in steps) for p in parts if all(k in p for k in steps)]
    if held:
        got["held_s"] = round(sum(held) / len(held), 2)
    if fixed:
        got["restart_fixed_s"] = round(sum(fixed) / len(fixed), 2)
    changes = [s for r in runs if r.get("ft") for s in r.get("quorum_change_s") or []]
    if changes:
        got["quorum_change_s"] = round(sum(changes) / len(changes), 3)
    ft = [r["full_pace"] for r in runs if r.get("ft") and r.get("full_pace")]
    other = [r["full_pace"] for r in runs if not r.get("ft") and r.get("full_pace")]
    if ft and other:
        got["quorum_overhead"] = round(max(0.0, 1.0 - (sum(ft) / len(ft)) / (sum(other) / len(other))), 4)
    return replace(inputs, **got, measured={"from": path, "fields": sorted(got)})


def assumptions(inputs: Inputs) -> list[str]:
    """Each input, its value and where it comes from (a bench result's, where one replaced it)."""
    measured = set(inputs.measured.get("fields", []))
    return [f"{name} = {getattr(inputs, name)}: "
            + (f"measured in {inputs.measured['from']}" if name in measured else source)
            for name, source in SOURCES.items()]


def format_rows(rows: list[dict], inputs: Inputs) -> str:
    """Per preemption rate: each strategy's goodput at each GPU count, then the restart's and the
    quorum change's cost; the assumptions last."""
    gpus = sorted({r["gpus"] for r in rows})
    lines = ["projection (a model, not a measurement; its inputs below)"]
    for rate in dict.fromkeys(r["rate_per_node_h"] for r in rows):
        mine = [r for r in rows if r["rate_per_node_h"] == rate]
        lines.append(f"\n{rate:g} preemptions per node-hour ({inputs.gpus_per_node} GPUs a node): goodput")
        lines.append(f"{'':<22}" + "".join(f"{n:>9}" for n in gpus))
        for s in dict.fromkeys(r["strategy"] for r in mine):
            by = {r["gpus"]: r for r in mine if r["strategy"] == s}
            lines.append(f"{s:<22}" + "".join(f"{100 * by[n]['goodput']:>8.2f}%" for n in gpus))
    first = {r["gpus"]: r for r in rows}
    lines.append("\n" + f"{'group restart (s)':<22}" + "".join(f"{first[n]['restart_s']:>9.1f}" for n in gpus))
    lines.append(f"{'quorum change (s)':<22}" + "".join(f"{first[n]['quorum_change_s']:>9.2f}" for n in gpus))
    lines.append("\nassumptions:")
    lines.extend(f"  {a}" for a in assumptions(inputs))
    lines.append("  not modelled: preemptions without notice, several nodes at once, stockouts, stragglers")
    return "\n".join(lines)


def write_results(rows: list[dict], inputs: Inputs, out_dir: str) -> list[str]:
    """preemption-project.json (rows, inputs, assumptions), .csv and .png: the recovery cost against
    the group's size, and goodput per strategy against it (one line style per preemption rate)."""
    fig, (cost, good) = results.new_figure(ncols=2, figsize=(11, 4.5))
    gpus = sorted({r["gpus"] for r in rows})
    first = {r["gpus"]: r for r in rows}
    cost.plot(gpus, [first[n]["restart_s"] for n in gpus], marker="o", label="whole-group restart")
    cost.plot(gpus, [first[n]["quorum_change_s"] for n in gpus], marker="o", label="quorum change (ft)")
    project.gpu_axis(cost, gpus)
    cost.set(ylabel="seconds", title="Recovery cost against the group's size")
    cost.legend(fontsize=7)
    styles = ["-", "--", ":", "-."]
    colors = {s: f"C{i}" for i, s in enumerate(dict.fromkeys(r["strategy"] for r in rows))}
    for i, rate in enumerate(dict.fromkeys(r["rate_per_node_h"] for r in rows)):
        for s, color in colors.items():
            mine = [r for r in rows if r["rate_per_node_h"] == rate and r["strategy"] == s]
            good.plot([r["gpus"] for r in mine], [r["goodput"] for r in mine], color=color,
                      linestyle=styles[i % len(styles)], marker=".", label=f"{s}, {rate:g}/node-h")
    project.gpu_axis(good, gpus)
    good.set(ylabel="goodput (projected)", title="Goodput per strategy (a model; inputs in the JSON)")
    good.legend(fontsize=6)
    fig.suptitle("Preemption projection: a model from measured and published figures", fontsize=8)
    return results.write(out_dir, "preemption-project", rows,
                         {"inputs": asdict(inputs), "assumptions": assumptions(inputs)}, fig)
