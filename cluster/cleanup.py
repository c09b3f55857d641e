"""Nothing left billing: what a failed `ray up` made, what `ray down` leaves, what Ray's bootstrap adds.

- A `ray up` that fails (the head's setup, a stock-out, Ctrl-C) leaves the VMs
  it made running: the head, its boot disk and external IP, and any worker the
  head's autoscaler had started. :func:`after_failed_up` deletes the cluster's
  VMs that were not there before `ray up` ran (those that were are left as
  they were), or, when asked to keep them, says what each one bills and the
  commands that delete it.
- `ray down` lists running VMs only; :func:`cluster.compute.delete_left_vms`
  and :func:`cluster.compute.delete_left_disks` delete the stopped ones and
  the disks no VM uses (``autoDelete: false``) after it.
- Ray's bootstrap leaves two things in the project that bill nothing but
  outlive every cluster: the SSH key it put in the project's metadata (from the
  machine that ran `ray up`; every VM of the project accepts it) and the
  service account ``ray-autoscaler-sa-v1`` with compute.admin and three more
  roles. :func:`purge_bootstrap` removes both, this machine's key only, and
  only once no Ray cluster's VM is left in the project.
"""

from __future__ import annotations

import glob
import os
from typing import Callable

from cluster.bootstrap import RAY_ACCOUNT, ProjectApis, Refused
from cluster.compute import Compute, Instance

Say = Callable[[str], None]


def after_failed_up(compute: Compute, zone: str, cluster: str, before: set[str], keep: bool, say: Say,
                    cluster_file: str) -> list[Instance]:
    """Delete (or, ``keep``, describe) the cluster's VMs that `ray up` made: those not in ``before``."""
    now = compute.instances(zone, cluster)
    made = [vm for vm in now if vm.name not in before]
    kept = sorted(vm.name for vm in now if vm.name in before)
    if kept:
        say(f"left as they were (there before `ray up`): {', '.join(kept)}")
    if not made:
        say(f"`ray up` failed and left no VM of cluster {cluster} in {zone}")
        return []
    if keep:
        say(f"`ray up` failed; kept what it made (--keep-on-failure), billing until deleted:")
        for line in billing_lines(made):
            say("  " + line)
        say(f"delete it all: launcher cluster down {cluster_file}")
        say(f"  or: gcloud compute instances delete {' '.join(vm.name for vm in made)} --zone {zone} "
            f"--project {compute.project} --quiet")
        return made
    say(f"`ray up` failed: deleting the {len(made)} VM(s) it made (--keep-on-failure keeps them):")
    for line in billing_lines(made):
        say("  " + line)
    compute.delete_instances(zone, [vm.name for vm in made])
    kept_disks = [d for vm in made for d, _, auto in vm.disks if not auto]
    say(f"deleted {', '.join(vm.name for vm in made)} and their auto-delete disks" + (
        f"; disk(s) {', '.join(kept_disks)} stay (autoDelete false): launcher cluster down {cluster_file} deletes "
        "them" if kept_disks else ""))
    return made


def billing_lines(vms: list[Instance]) -> list[str]:
    """One line a VM: what it is and what of it bills (a stopped VM bills its disks only)."""
    lines = []
    for vm in vms:
        disks = ", ".join(f"disk {name} {gb} GB" for name, gb, _ in vm.disks) or "no disk"
        ips = f", external IP {', '.join(vm.external_ips)}" if vm.external_ips else ""
        what = "bills its disks" if vm.status == "TERMINATED" else "bills by the second"
        lines.append(f"{vm.name}: {vm.machine_type}, {vm.status} ({what}); {disks}{ips}")
    return lines


def ray_key_files(region: str, project: str, ssh_user: str, home: str | None = None) -> list[str]:
    """The key pairs Ray's bootstrap wrote on this machine for the project (``~/.ssh/ray-autoscaler_gcp_...``)."""
    ssh = os.path.join(home or os.path.expanduser("~"), ".ssh")
    return sorted(glob.glob(os.path.join(ssh, f"ray-autoscaler_gcp_{region}_{project}_{ssh_user}_[0-9]")))


def purge_bootstrap(compute: Compute, apis: ProjectApis, region: str, ssh_user: str, say: Say) -> bool:
    """Remove this machine's Ray SSH key from the project's metadata (and the local pair) and Ray's
    service account with its role bindings; nothing while a Ray cluster's VM is left. Returns whether done."""
    p = compute.project
    others = compute.ray_vms()
    if others:
        names = ", ".join(f"{vm.name} (cluster {vm.cluster})" for vm in others[:5])
        say(f"not removing Ray's SSH key and service account from project {p}: Ray cluster VMs still use them: "
            f"{names}")
        return False
    _remove_key(compute, region, ssh_user, say)
    account = RAY_ACCOUNT.format(project=p)
    try:
        policy = apis.policy()
        member = f"serviceAccount:{account}"
        bindings = [{**b, "members": [m for m in b.get("members", []) if m != member]}
                    for b in policy.get("bindings", [])]
        roles = [b["role"] for b in policy.get("bindings", []) if member in b.get("members", [])]
        if roles:
            apis.set_policy({**policy, "bindings": [b for b in bindings if b["members"]]})
            say(f"removed {account} from project {p}'s IAM policy ({', '.join(roles)})")
        if apis.account(account) is not None:
            apis.delete_account(account)
            say(f"deleted service account {account}")
        else:
            say(f"service account {account}: not there")
    except Refused as exc:
        say(f"could not remove service account {account} ({exc.status}: {exc.message[:120]}); by hand: "
            f"gcloud iam service-accounts delete {account} --project {p}")
        return False
    return True


def _remove_key(compute: Compute, region: str, ssh_user: str, say: Say) -> None:
    files = ray_key_files(region, compute.project, ssh_user)
    ours = set()
    for path in files:
        try:
            with open(path + ".pub", encoding="utf-8") as f:
                ours.add(f.read().split()[1])
        except (OSError, IndexError):
            continue
    project = compute.project_info()
    lines = (project.metadata.get("ssh-keys", "") if project else "").splitlines()
    kept = [line for line in lines if not (len(line.split()) == 3 and line.split()[1] in ours)]
    if project is not None and len(kept) < len(lines):
        items = dict(project.metadata)
        if kept:
            items["ssh-keys"] = "\n".join(kept)
        else:
            items.pop("ssh-keys")
        compute.set_metadata(items, project.fingerprint)
        say(f"removed {len(lines) - len(kept)} SSH key(s) of Ray's from project {compute.project}'s metadata")
    else:
        say(f"no SSH key of Ray's from this machine in project {compute.project}'s metadata (keys added from "
            "other machines stay: see `gcloud compute project-info describe`)")
    for path in files:
        for name in (path, path + ".pub"):
            if os.path.exists(name):
                os.remove(name)
    if files:
        say(f"deleted the local key pair(s): {', '.join(files)}")
