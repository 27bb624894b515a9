"""The HCCL rank table: write one for a list of nodes, and check one a user wrote.

HCCL (and torch_npu when ``RANK_TABLE_FILE`` is set) reads the cluster layout from a JSON
file in this shape (Ascend "hccl.json", version 1.0; numbers are written as strings)::

    {
      "version": "1.0",
      "server_count": "2",
      "server_list": [
        {"server_id": "10.0.0.1",
         "device": [{"device_id": "0", "device_ip": "192.168.100.101", "rank_id": "0"}, ...]},
        {"server_id": "10.0.0.2",
         "device": [{"device_id": "0", "device_ip": "192.168.100.102", "rank_id": "8"}, ...]}
      ],
      "status": "completed"
    }

``server_id`` is the host IP of a node, ``device_id`` the NPU's index on that node,
``device_ip`` the IP of the NPU's own network port (read it on each node with
``hccn_tool -i <device_id> -ip -g``) and ``rank_id`` the global rank. Ranks are numbered
node by node: node k, device d has rank ``k * devices_per_node + d``.

Device IP file (``--device-ips``), either JSON or text, mapping each node IP to its device
IPs in device-id order::

    {"10.0.0.1": ["192.168.100.101", "192.168.101.101"], "10.0.0.2": [...]}

    # text: one node per line, node IP then its device IPs (spaces or commas); '#' comments
    10.0.0.1  192.168.100.101 192.168.101.101
    10.0.0.2  192.168.100.102 192.168.101.102

Without a device IP file the table gets *placeholder* device IPs, ``198.18.<node>.<device+1>``
(the RFC 2544 benchmarking range, never a real NPU port), and a top-level
``"canntrain_placeholder_device_ips": true`` so that nobody mistakes it for a real one:
fine for tests and for learning the format, useless for HCCL on a real cluster.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from canntrain_core.errors import BadInput

VERSIONS = ("1.0",)
PLACEHOLDER_KEY = "canntrain_placeholder_device_ips"
MAX_DEVICES_PER_NODE = 16  # Atlas servers carry 8 NPUs (16 on some A3 boxes)


class RankTableError(BadInput, ValueError):
    """A rank table, or the input for one, is wrong. ``problems`` lists every problem found."""

    def __init__(self, problems: list[str], source: str = "rank table"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def _is_ip(text: Any) -> bool:
    if not isinstance(text, str):
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _as_int(value: Any) -> int | None:
    """HCCL writes numbers as decimal strings; accept those (and plain ints), nothing else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def placeholder_device_ip(node_index: int, device_id: int) -> str:
    """The documented stand-in device IP for tests: 198.18.<node>.<device+1>."""
    if not 0 <= node_index < 512:
        raise RankTableError([f"placeholder device IPs cover at most 512 nodes, got node #{node_index}"])
    return str(ipaddress.IPv4Address("198.18.0.0") + node_index * 256 + device_id + 1)


# --------------------------------------------------------------------------- device IP file


def load_device_ips(path: str | Path) -> dict[str, list[str]]:
    """Read a node IP -> device IPs mapping from a JSON or text file (format: module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise RankTableError(["file not found"], source=f"device IP file {p}")
    text = p.read_text()
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RankTableError([f"invalid JSON at line {e.lineno}: {e.msg}"], source=f"device IP file {p}") from None
        bad = [
            f"node {k!r}: expected a list of device IPs, got {type(v).__name__}"
            for k, v in data.items()
            if not isinstance(v, list)
        ]
        if bad:
            raise RankTableError(bad, source=f"device IP file {p}")
        return {str(k): [str(ip) for ip in v] for k, v in data.items()}
    mapping: dict[str, list[str]] = {}
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields:
            continue
        if len(fields) < 2:
            problems.append(f"line {lineno}: expected 'NODE_IP DEVICE_IP...', got {line.strip()!r}")
        elif fields[0] in mapping:
            problems.append(f"line {lineno}: node {fields[0]} listed twice")
        else:
            mapping[fields[0]] = fields[1:]
    if problems:
        raise RankTableError(problems, source=f"device IP file {p}")
    return mapping


# --------------------------------------------------------------------------- build


def build_rank_table(
    nodes: list[str], devices_per_node: int, device_ips: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """The rank table for ``nodes`` (host IPs, rank order) with ``devices_per_node`` NPUs each.

    ``device_ips`` maps each node to its device IPs in device-id order; None means
    placeholders (see the module docstring). Raises RankTableError listing every bad input.
    """
    problems = []
    if not nodes:
        problems.append("--nodes: no node given")
    if not 1 <= devices_per_node <= MAX_DEVICES_PER_NODE:
        problems.append(f"--devices-per-node: must be 1..{MAX_DEVICES_PER_NODE}, got {devices_per_node}")
    for node, n in Counter(nodes).items():
        if n > 1:
            problems.append(f"--nodes: {node} listed {n} times")
    for node in dict.fromkeys(nodes):
        if not _is_ip(node):
            problems.append(f"--nodes: {node!r} is not an IP address (server_id must be the node's host IP)")
    if device_ips is not None:
        problems += _device_ip_problems(nodes, devices_per_node, device_ips)
    if problems:
        raise RankTableError(problems, source="rank-table input")

    servers = []
    for k, node in enumerate(nodes):
        devices = []
        for d in range(devices_per_node):
            ip = device_ips[node][d] if device_ips is not None else placeholder_device_ip(k, d)
            devices.append({"device_id": str(d), "device_ip": ip, "rank_id": str(k * devices_per_node + d)})
        servers.append({"server_id": node, "device": devices})
    table: dict[str, Any] = {
        "version": "1.0",
        "server_count": str(len(nodes)),
        "server_list": servers,
        "status": "completed",
    }
    if device_ips is None:
        table[PLACEHOLDER_KEY] = True
    return table


def _device_ip_problems(nodes: list[str], per_node: int, device_ips: dict[str, list[str]]) -> list[str]:
    problems = []
    for node in dict.fromkeys(nodes):
        ips = device_ips.get(node)
        if ips is None:
            problems.append(f"--device-ips: no device IPs for node {node}")
            continue
        if len(ips) != per_node:
            problems.append(f"--device-ips: node {node} has {len(ips)} device IPs, --devices-per-node is {per_node}")
        for d, ip in enumerate(ips):
            if not _is_ip(ip):
                problems.append(f"--device-ips: node {node} device {d}: {ip!r} is not an IP address")
    for node in device_ips:
        if node not in nodes:
            problems.append(f"--device-ips: node {node} is not in --nodes")
    seen: dict[str, str] = {}
    for node in nodes:
        for d, ip in enumerate(device_ips.get(node, [])):
            if ip in seen:
                problems.append(f"--device-ips: device IP {ip} of node {node} device {d} already used by {seen[ip]}")
            seen.setdefault(ip, f"node {node} device {d}")
    return problems


def write_rank_table(table: dict[str, Any], path: str | Path) -> Path:
    """Write the table as indented JSON (via a temporary file, then rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=2) + "\n")
    tmp.replace(out)
    return out


# --------------------------------------------------------------------------- check


def load_rank_table(path: str | Path) -> dict[str, Any]:
    """Parse a rank table file; a missing file or bad JSON is a RankTableError."""
    p = Path(path)
    if not p.is_file():
        raise RankTableError(["file not found"], source=str(p))
    try:
        table = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise RankTableError([f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"], source=str(p)) from None
    if not isinstance(table, dict):
        raise RankTableError([f"top level must be a JSON object, got {type(table).__name__}"], source=str(p))
    return table


def check_rank_table(table: dict[str, Any], world_size: int | None = None) -> list[str]:
    """Every problem in a rank table, each naming the server/device/field; [] when valid."""
    problems = []
    if table.get("version") not in VERSIONS:
        problems.append(f"version: must be one of {list(VERSIONS)}, got {table.get('version')!r}")
    if table.get("status") != "completed":
        problems.append(f"status: must be 'completed' (HCCL waits until it is), got {table.get('status')!r}")
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        problems.append(f"server_list: must be a non-empty list, got {servers!r}")
        return problems
    count = _as_int(table.get("server_count"))
    if count is None:
        problems.append(f"server_count: must be a non-negative integer, got {table.get('server_count')!r}")
    elif count != len(servers):
        problems.append(f"server_count: says {count} but server_list has {len(servers)} servers")

    ranks: dict[int, str] = {}
    device_ips: dict[str, str] = {}
    server_ids: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for i, server in enumerate(servers):
        if not isinstance(server, dict):
            problems.append(f"server_list[{i}]: must be an object, got {type(server).__name__}")
            continue
        sid = server.get("server_id")
        where = f"server_list[{i}] (server_id {sid})"
        if not _is_ip(sid):
            problems.append(f"{where}: server_id: {sid!r} is not an IP address")
        elif sid in server_ids:
            problems.append(f"{where}: server_id: {sid} already used by {server_ids[sid]}")
        else:
            server_ids[sid] = f"server_list[{i}]"
        devices = server.get("device")
        if not isinstance(devices, list) or not devices:
            problems.append(f"{where}: device: must be a non-empty list, got {devices!r}")
            continue
        sizes[where] = len(devices)
        problems += _check_devices(where, devices, ranks, device_ips)

    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{w}: {n}" for w, n in sizes.items())
        problems.append(f"device counts differ across servers ({detail}); every node must have the same number")
    total = sum(sizes.values())
    if ranks:
        missing = sorted(set(range(total)) - set(ranks))
        beyond = sorted(r for r in ranks if r >= total)
        if missing:
            problems.append(
                f"rank_id: ranks must be 0..{total - 1} with no gaps; missing {missing}"
                + (f", while {beyond} are beyond the {total} devices" if beyond else "")
            )
    if world_size is not None and total != world_size:
        problems.append(f"world size: the table has {total} devices but --world-size is {world_size}")
    return problems


def _check_devices(where: str, devices: list, ranks: dict[int, str], device_ips: dict[str, str]) -> list[str]:
    problems = []
    ids: dict[int, int] = {}
    for j, dev in enumerate(devices):
        if not isinstance(dev, dict):
            problems.append(f"{where} device[{j}]: must be an object, got {type(dev).__name__}")
            continue
        did = _as_int(dev.get("device_id"))
        here = f"{where} device[{j}] (device_id {dev.get('device_id')})"
        if did is None:
            problems.append(f"{here}: device_id: must be a non-negative integer, got {dev.get('device_id')!r}")
        elif did in ids:
            problems.append(f"{here}: device_id: {did} duplicates device[{ids[did]}] on the same server")
        else:
            ids[did] = j
        ip = dev.get("device_ip")
        if not _is_ip(ip):
            problems.append(f"{here}: device_ip: {ip!r} is not an IP address")
        elif ip in device_ips:
            problems.append(f"{here}: device_ip: {ip} already used by {device_ips[ip]}")
        else:
            device_ips[ip] = here
        rank = _as_int(dev.get("rank_id"))
        if rank is None:
            problems.append(f"{here}: rank_id: must be a non-negative integer, got {dev.get('rank_id')!r}")
        elif rank in ranks:
            problems.append(f"{here}: rank_id: {rank} duplicates {ranks[rank]}")
        else:
            ranks[rank] = here
    return problems


def summarize(table: dict[str, Any]) -> str:
    """One paragraph on a valid table: servers, devices per server, world size, placeholders."""
    servers = table["server_list"]
    per = len(servers[0]["device"])
    lines = [
        f"rank table: version {table['version']}, {len(servers)} server(s) x {per} device(s) = "
        f"world size {len(servers) * per}"
    ]
    for s in servers:
        r = sorted(int(d["rank_id"]) for d in s["device"])
        lines.append(f"  {s['server_id']}: ranks {r[0]}..{r[-1]}")
    if table.get(PLACEHOLDER_KEY):
        lines.append(
            "  WARNING: device IPs are placeholders (made without --device-ips); HCCL cannot use them on a real cluster"
        )
    return "\n".join(lines)


def _check_main(argv: list[str] | None = None) -> int:
    """``python rank_table.py FILE [WORLD_SIZE]``: the check alone, run by path from
    scripts/run_pretrain.sh so that it skips the package imports (torch); 0 valid, 1 not."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        table = load_rank_table(argv[0])
        problems = check_rank_table(table, int(argv[1]) if len(argv) > 1 else None)
        if problems:
            raise RankTableError(problems, source=argv[0])
    except RankTableError as e:
        print(e, file=sys.stderr)
        return 1
    print(summarize(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(_check_main())
