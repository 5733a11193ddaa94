"""A local Ray cluster started by ``initialize('ray')`` listens on loopback only (issue 11)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

# In a fresh interpreter: no Ray already running in this one can hide what initialize() starts.
PROBE = """
import json, sys
import psutil
import twinkle_core as tw

def listening():
    me = psutil.Process()
    found = []
    for p in [me, *me.children(recursive=True)]:
        try:
            found += [[p.name(), c.laddr.ip] for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return found

def node_address():
    import ray
    return ray.nodes()[0]["NodeManagerAddress"]

out = {}
tw.initialize("ray", num_cpus=1)
out["default"] = {"listen": listening(), "node": node_address()}
tw.shutdown()
if sys.argv[1] != "-":
    tw.initialize("ray", num_cpus=1, _node_ip_address=sys.argv[1])
    out["asked"] = {"listen": listening(), "node": node_address()}
    tw.shutdown()
print("PROBE", json.dumps(out), flush=True)
"""


def _public_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a.address)
            except ValueError:
                continue
            if ip.version == 4 and not ip.is_loopback:
                return a.address
    return None


def test_local_cluster_listens_on_loopback_unless_asked() -> None:
    public = _public_address()
    run = subprocess.run([sys.executable, "-c", PROBE, public or "-"], capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("PROBE "))

    default = out["default"]
    assert default["node"] == "127.0.0.1"
    assert default["listen"], "no listening socket found: the probe saw nothing of Ray's servers"
    exposed = [
        (name, ip) for name, ip in default["listen"] if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback
    ]
    assert not exposed, f"Ray servers listening beyond loopback: {exposed}"

    if public is not None:  # the user's own address is honoured
        assert out["asked"]["node"] == public
