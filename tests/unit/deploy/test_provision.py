"""What provisioning writes stays private: FLARE's cert.json holds the root CA's and every participant's key."""

import json
import os
import subprocess

import yaml

from pflseg.deploy.provision import REPO_PROJECT, loopback_env, loopback_project


def test_provisioning_keeps_every_private_key_private(tmp_path):
    """Before: `nvflare provision -p provisioning/project.yml` left state/cert.json, which holds every private key,
    at 0644 in a 0755 folder. PflsegBuilder (in project.yml) makes them 0600 / 0700, whatever the umask."""
    project = loopback_project(yaml.safe_load(REPO_PROJECT.read_text()), tmp_path, 8002)
    yml = tmp_path / "project.yml"
    yml.write_text(yaml.safe_dump(project, sort_keys=False))
    (tmp_path / "home").mkdir()
    previous = os.umask(0o022)
    try:
        proc = subprocess.run(["nvflare", "provision", "-p", str(yml), "-w", str(tmp_path / "prov")],
                              env=loopback_env(tmp_path), capture_output=True, text=True)
    finally:
        os.umask(previous)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    state = tmp_path / "prov" / project["name"] / "state"
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert "root_pri_key" in json.loads((state / "cert.json").read_text())  # FLARE filled the file pflseg made
    assert mode(state) == 0o700 and mode(state / "cert.json") == 0o600
    keys = sorted((tmp_path / "prov").rglob("*.key"))
    assert keys and {mode(k) for k in keys} == {0o600}


def test_no_kits_internal_listener_can_take_the_servers_port(tmp_path):
    """Before: FLARE picked the server's internal listener port at random in 1025-65535 before its external
    listener bound; once in the suite it took the server's own port and the server never listened. Every kit now
    has a comm_config.json whose port ranges, as FLARE's own parser reads them, hold every port but the server's."""
    from nvflare.fuel.f3.drivers.net_utils import parse_port_list

    from pflseg.deploy.provision import provision_loopback

    kits = provision_loopback(tmp_path, port=38103)
    configs = sorted(kits.glob("*/local/comm_config.json"))
    assert {c.parent.parent.name for c in configs} == {"localhost", "site-1", "site-2", "site-3"}
    for config in configs:
        internal = json.loads(config.read_text())["internal"]
        assert internal["scheme"] == "tcp" and internal["resources"]["host"] == "localhost"
        ports = [p for r in parse_port_list(internal["resources"]["ports"]) for p in r]
        assert 38103 not in ports and len(ports) == len(set(ports)) == 65535 - 1025
    # the server's processes (not the sites') get a fixed mmap threshold, before the server starts
    export = 'export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-131072}"'
    server = (kits / "localhost" / "startup" / "sub_start.sh").read_text()
    assert server.startswith("#!") and export in server.splitlines()[1]
    assert server.index(export) < server.index("server_train")
    assert export not in (kits / "site-1" / "startup" / "sub_start.sh").read_text()
