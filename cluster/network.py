"""Preflight of a cluster's network: the subnet each node lands on, and the firewall rules between them.

Where a node lands: a node_config that names ``networkInterfaces`` gets what it
names (a ``subnetwork``, or a ``network``, where an auto-mode VPC has a subnet
in every region and a custom-mode VPC is refused without a subnetwork); one
that names none gets Ray's default, the first subnet the region lists, of
whichever network (``_configure_subnet`` in Ray's bootstrap). All nodes must
share one network.

What must pass the firewall (Ray creates no rule; Compute Engine's rules are
read as it applies them: the enabled ingress rules of the network that match
the target VM, the source and the port, lowest priority number first, a deny
winning a tie, and everything else denied): SSH (tcp:22) from outside to the
head, which `ray up` reaches on its external IP; and every TCP port between
the nodes, since Ray's GCS (6379), object manager (8076), worker ports
(10002-19999) and the raylets' and agents' randomly chosen ports all take
connections from the other nodes. A default VPC has both
(``default-allow-ssh``, ``default-allow-internal``); a new VPC has neither.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from cluster.checks import FAIL, OK, WARN, Check
from cluster.compute import Compute, Firewall, Subnet
from launcher.errors import LauncherError

SSH = 22
RAY_PORTS = (6379, 8076, 10002, 19999, 33017)  # GCS, object manager, worker ports, one a raylet might pick
IAP = ipaddress.ip_network("35.235.240.0/20")  # Identity-Aware Proxy's range: ssh through IAP, not Ray's
# Addresses inside a VPC (RFC 1918 and shared address space): a rule from them lets no user in from outside.
INSIDE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"))


def network_checks(config: dict[str, Any], compute: Compute, region: str) -> list[Check]:
    p = compute.project
    try:
        subnets = compute.subnets(region)
    except LauncherError as exc:  # no permission: said with the permissions
        return [Check(WARN, f"cannot list the subnets of {region}: {exc.what}")]
    placed, checks, seen = {}, [], {}
    for name, node_type in config["available_node_types"].items():
        nc = node_type.get("node_config") or {}
        key = _interface_key(node_type)
        if key not in seen:  # node types that name the same interface land alike: one check for them
            names = [n for n, t in config["available_node_types"].items() if _interface_key(t) == key]
            seen[key] = _placement(", ".join(names), nc, subnets, compute, region)
            checks += [seen[key][1]] if seen[key][1] else []
        if seen[key][0]:
            placed[name] = seen[key][0]
    if len(placed) < len(config["available_node_types"]):
        return checks
    networks = sorted({s.network for s in placed.values()})
    if len(networks) > 1:
        where = ", ".join(f"{n} on {s.network}" for n, s in placed.items())
        return checks + [Check(FAIL, f"the nodes are on different networks ({where}): they cannot reach each other",
                               "put every node type on one network (launcher cluster config --network / --subnetwork)")]
    if not checks:
        checks.append(Check(OK, f"every node lands on subnet {_names(placed)} of network {networks[0]} in {region}"))
    try:
        rules = compute.firewalls()
    except LauncherError as exc:
        return checks + [Check(WARN, f"cannot list project {p}'s firewall rules ({exc.what}): not checked that SSH "
                               "reaches the head and the nodes reach each other")]
    return checks + _firewall_checks(config, placed, networks[0], rules, p)


def _placement(node_type: str, node_config: dict, subnets: list[Subnet], compute: Compute,
               region: str) -> tuple[Subnet | None, Check | None]:
    """The subnet a node type lands on, or the check that says why it has none (or, with a subnet, warns)."""
    p = compute.project
    nic = (node_config.get("networkInterfaces") or [None])[0]
    if nic is None:  # Ray's bootstrap: the region's first subnet, of any network
        if not subnets:
            return None, Check(FAIL, f"region {region} has no subnet: Ray's bootstrap puts {node_type} on the "
                               "region's first subnet, and stops", f"gcloud compute networks create ray --project {p} "
                               "--subnet-mode=auto (or --subnetwork one you made)")
        if len({s.network for s in subnets}) > 1:
            return subnets[0], Check(WARN, f"{node_type} lands on {subnets[0].name} of network {subnets[0].network}, "
                                     f"the first of {region}'s subnets (they belong to networks "
                                     f"{', '.join(sorted({s.network for s in subnets}))})",
                                     "name the one you want: launcher cluster config --subnetwork SUBNET")
        return subnets[0], None
    network, subnetwork = _last(nic.get("network")), _last(nic.get("subnetwork"))
    if subnetwork:
        found = next((s for s in subnets if s.name == subnetwork), None)
        if found is None:
            return None, Check(FAIL, f"{node_type}: subnetwork {subnetwork} does not exist in {region}",
                               f"pick one of `gcloud compute networks subnets list --regions {region} --project {p}`")
        if network and found.network != network:
            return None, Check(FAIL, f"{node_type}: subnetwork {subnetwork} belongs to network {found.network}, "
                               f"not {network}", f"use --network {found.network}, or a subnetwork of {network}")
        return found, None
    network = network or "default"
    auto = compute.network_auto_mode(network)
    if auto is None:
        return None, Check(FAIL, f"{node_type}: network {network} does not exist in project {p}",
                           f"pick one of `gcloud compute networks list --project {p}`")
    own = [s for s in subnets if s.network == network]
    if not auto:
        names = ", ".join(s.name for s in own) or "none yet"
        return None, Check(FAIL, f"{node_type}: network {network} is a custom-mode VPC, and Compute Engine refuses a "
                           f"VM that names it without a subnetwork ({region}'s subnets of it: {names})",
                           f"launcher cluster config --network {network} --subnetwork SUBNET" if own else
                           f"gcloud compute networks subnets create ray-{region} --network {network} --region {region} "
                           f"--range 10.10.0.0/20 --project {p}")
    if not own:
        return None, Check(FAIL, f"{node_type}: network {network} has no subnet in {region}",
                           f"gcloud compute networks subnets create ray-{region} --network {network} "
                           f"--region {region} --range 10.10.0.0/20 --project {p}")
    return own[0], None


def _interface_key(node_type: dict) -> tuple[str, str, bool]:
    nc = node_type.get("node_config") or {}
    nic = (nc.get("networkInterfaces") or [None])[0] or {}
    return _last(nic.get("network")), _last(nic.get("subnetwork")), "networkInterfaces" in nc


def _firewall_checks(config: dict, placed: dict[str, Subnet], network: str, rules: list[Firewall],
                     p: str) -> list[Check]:
    types = config["available_node_types"]
    head = config.get("head_node_type")
    checks = [_ssh_check(types.get(head, {}).get("node_config") or {}, network, rules, p)]
    workers = [n for n in types if n != head and int(types[n].get("max_workers", 0) or 0) > 0]
    if not workers:
        return checks
    blocked = set()
    for source in types:
        src_ip = str(next(ipaddress.ip_network(placed[source].cidr).hosts()))
        for target in types:
            nc = types[target].get("node_config") or {}
            for port in RAY_PORTS:
                if not _passes(rules, network, nc, "tcp", port, src_ip, _tags(types[source].get("node_config"))):
                    blocked.add((port, placed[source].cidr))
    if not blocked:
        checks.append(Check(OK, f"firewall: the nodes reach each other on every TCP port Ray uses (network {network})"))
        return checks
    cidrs = ",".join(sorted({s.cidr for s in placed.values()}))
    ports = ", ".join(str(port) for port in sorted({port for port, _ in blocked}))
    checks.append(Check(FAIL, f"firewall: network {network} blocks tcp {ports} between the nodes ({cidrs}): Ray's "
                        "GCS, object manager and worker ports (and the random ports of its raylets) must take "
                        "connections from every node", f"gcloud compute firewall-rules create ray-internal "
                        f"--project {p} --network {network} --direction INGRESS --allow tcp,udp,icmp "
                        f"--source-ranges {cidrs}"))
    return checks


def _ssh_check(head: dict, network: str, rules: list[Firewall], p: str) -> Check:
    """tcp:22 reaches the head from some address outside the VPC (the user's must be among them)."""
    for rule in sorted(rules, key=lambda r: r.priority):
        if rule.network != network or rule.disabled or rule.direction != "INGRESS":
            continue
        for source in rule.source_ranges or ("0.0.0.0/0",):
            net = ipaddress.ip_network(source, strict=False)
            if any(net.subnet_of(inside) for inside in INSIDE) or net.subnet_of(IAP):
                continue
            probe = str(net.network_address + (1 if net.num_addresses > 1 else 0))
            if _covers(rule.allowed, "tcp", SSH) and _passes(rules, network, head, "tcp", SSH, probe, ()):
                where = "anywhere" if net.prefixlen == 0 else f"{source} only (your address must be in it)"
                return Check(OK, f"firewall: SSH (tcp:22) reaches the head from {where} (rule {rule.name})")
    return Check(FAIL, f"firewall: no rule of network {network} lets SSH (tcp:22) reach the head from outside the "
                 "VPC: `ray up` would wait 900 s for SSH, then fail",
                 f"gcloud compute firewall-rules create ray-ssh --project {p} --network {network} --direction INGRESS "
                 "--allow tcp:22 --source-ranges YOUR_IP/32")


def _passes(rules: list[Firewall], network: str, target: dict, proto: str, port: int, source_ip: str,
            source_tags: tuple[str, ...]) -> bool:
    """Whether Compute Engine lets an ingress connection through to a VM of ``target`` (a node_config)."""
    tags, accounts = _tags(target), {a.get("email") for a in target.get("serviceAccounts") or []}
    best: tuple[int, int] | None = None
    for r in rules:
        if r.disabled or r.direction != "INGRESS" or r.network != network:
            continue
        if (r.target_tags and not set(r.target_tags) & set(tags)) or \
                (r.target_accounts and not set(r.target_accounts) & accounts):
            continue
        if (r.source_ranges or r.source_tags) and not (
                any(ipaddress.ip_address(source_ip) in ipaddress.ip_network(s, strict=False) for s in r.source_ranges)
                or set(r.source_tags) & set(source_tags)):
            continue
        for denies, entries in ((0, r.denied), (1, r.allowed)):
            if _covers(entries, proto, port) and (best is None or (r.priority, denies) < best):
                best = (r.priority, denies)
    return best is not None and best[1] == 1


def _covers(entries, proto: str, port: int) -> bool:
    numbers = {"tcp": "6", "udp": "17", "icmp": "1"}
    for protocol, ports in entries:
        if protocol not in ("all", proto, numbers.get(proto)):
            continue
        if protocol == "all" or not ports or any(_in_range(port, p) for p in ports):
            return True
    return False


def _in_range(port: int, text: str) -> bool:
    low, _, high = text.partition("-")
    return int(low) <= port <= int(high or low)


def _tags(node_config: dict | None) -> tuple[str, ...]:
    return tuple(((node_config or {}).get("tags") or {}).get("items") or ())


def _names(placed: dict[str, Subnet]) -> str:
    return "/".join(sorted({s.name for s in placed.values()}))


def _last(url: Any) -> str:
    return str(url or "").rstrip("/").rsplit("/", 1)[-1]
