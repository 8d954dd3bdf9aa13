"""Several nodes on one machine: network namespaces as nodes (tests/netns_cluster.py), a real Ray
cluster over them, and megarl's placement and rendezvous addresses checked across them.

Each node has its own address on a private bridge and its own loopback, so 127.0.0.1 or an
address from /etc/hosts does not reach another node, as on a real cluster. Needs root (CI runs as
root); skipped otherwise, which CI counts as a failure.
"""
from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.netns_cluster import PREFIX, NetnsCluster, RayBox, pid_alive, namespace_pids, netns_available

ROOT = Path(__file__).resolve().parent.parent
_why = netns_available()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

# Node layout of the Ray cluster, as train_disagg.sbatch marks a job with 2 trainer nodes and
# 1 rollout node (one unit per node, so a 2-rank pool must span both trainer nodes).
LAYOUT = [{"megarl_train": 1}, {"megarl_train": 1}, {"megarl_rollout": 1}]
TRAIN_A, TRAIN_B, ROLLOUT = 0, 1, 2
HANG_S = 300   # a hang guard for a subprocess's start or teardown, not an expected time


def _netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split(" ", 1)[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def pair(netns_cluster):
    box = netns_cluster(2)
    yield box
    box.stop()
    assert not set(box.names) & _netns_list()


@pytest.fixture(scope="module")
def ray_box():
    t0 = time.time()
    with NetnsCluster(len(LAYOUT)) as box:
        with RayBox(box, LAYOUT, num_cpus=2, num_gpus=1, object_store_mb=100) as rb:
            print(f"\n[cluster-box] {len(LAYOUT)} Ray nodes up in {time.time() - t0:.1f}s: {box.addresses}")
            yield rb
    assert not set(box.names) & _netns_list()


def _driver(rb: RayBox, name: str, args: dict, timeout: float = 240) -> dict:
    return rb.driver(TRAIN_A, ["-m", "tests.cluster_box_drivers", name, json.dumps(args)], timeout=timeout)


# --------------------------------------------------------------------------------------- network

CLIENT = """
import json, socket, urllib.request
from megarl.wire.addresses import gloo_interface, node_address
def get(url):
    try:  # the refused loopback answers at once; 60 s only bounds a hang
        return urllib.request.urlopen(url, timeout=60).status
    except Exception as err:
        return type(err).__name__ + ": " + str(getattr(err, 'reason', err))
print(json.dumps({"peer": get("http://{peer}:{port}/"), "loopback": get("http://127.0.0.1:{port}/"),
                  "node_address": node_address(peer="{peer}"), "node_address_no_peer": node_address(),
                  "gloo_interface": gloo_interface("{peer}"), "gloo_interface_loopback": gloo_interface("127.0.0.1")}))
"""

WAIT_LISTEN = """
import json, socket, time
end = time.time() + 240   # python starting the server on a loaded box; only a hang guard
while time.time() < end:
    try:
        socket.create_connection(("127.0.0.1", {port}), 1).close(); print(json.dumps(True)); break
    except OSError:
        time.sleep(0.2)
else:
    print(json.dumps(False))
"""


def test_loopback_does_not_reach_another_node(pair):
    """A server in node 1 answers on node 1's address, and node 1's 127.0.0.1; node 0's
    127.0.0.1 is another machine's loopback and is refused. megarl's address for node 0 towards
    node 1 is node 0's bridge address (gloo binds eth0 for that peer)."""
    port = 18123
    pair.popen(1, [sys.executable, "-m", "http.server", str(port), "--bind", "0.0.0.0"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert pair.python(1, WAIT_LISTEN.format(port=port), timeout=300) is True
    seen = pair.python(0, CLIENT.replace("{peer}", pair.address(1)).replace("{port}", str(port)), timeout=300)
    assert seen["peer"] == 200, seen
    assert seen["loopback"].startswith("URLError") and "refused" in seen["loopback"], seen
    assert seen["node_address"] == seen["node_address_no_peer"] == pair.address(0), seen
    assert seen["gloo_interface"] == "eth0" and seen["gloo_interface_loopback"] is None, seen


HOLD = r"""
import faulthandler, json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import tests.netns_cluster as nc

# the signals the test sends act as they do for a user, whatever the CI's shell ignored or blocked
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
faulthandler.register(signal.SIGUSR1, all_threads=True)   # the test asks for the stack of a hang
mode = sys.argv[2]
if mode == "signal-after-netns-add":
    real_ip = nc._ip
    def ip(*args, **kw):
        done = real_ip(*args, **kw)
        if args[:2] == ("netns", "add") and args[2].endswith("-n1"):
            os.kill(os.getpid(), signal.SIGTERM)   # the kernel has made it, start() has not returned
        return done
    nc._ip = ip
with nc.NetnsCluster(2) as box:
    p = box.popen(1, ["sleep", "3600"])
    if mode == "second-signal-in-stop":
        real_remove = nc._remove_namespaces
        def remove(*args, **kw):
            os.kill(os.getpid(), signal.SIGINT)    # Ctrl-C again, in the middle of the teardown
            return real_remove(*args, **kw)
        nc._remove_namespaces = remove
    print(json.dumps({"names": box.names, "pid": p.pid}), flush=True)
    end = time.time() + 3600
    while time.time() < end:   # short sleeps: a signal landing just before one long sleep waits it out
        time.sleep(0.2)
"""


def _hold(tmp_path: Path, mode: str = "plain") -> subprocess.Popen:
    """hold.py: a NetnsCluster(2) with `sleep` in node 1, held until a signal (stderr to a file: the
    `sleep` inherits it, and a pipe would stay open after hold.py ends)."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    with (tmp_path / f"hold.{mode}.err").open("w") as err:
        return subprocess.Popen([sys.executable, str(script), str(ROOT), mode], stdout=subprocess.PIPE,
                                stderr=err, text=True)


def _held(holder: subprocess.Popen) -> dict:
    """hold.py's line, once its `sleep` is inside node 1 (nsenter may not have entered it yet)."""
    assert select.select([holder.stdout], [], [], HANG_S)[0], f"hold.py did not start in {HANG_S} s"
    info = json.loads(holder.stdout.readline())
    assert set(info["names"]) <= _netns_list()
    deadline = time.time() + HANG_S
    while namespace_pids(info["names"][1]) != [info["pid"]] and time.time() < deadline:
        time.sleep(0.1)
    assert namespace_pids(info["names"][1]) == [info["pid"]]
    return info


def _ended(holder: subprocess.Popen, tmp_path: Path) -> int:
    """hold.py's exit status; past HANG_S it fails with what hold.py was doing (its signal masks,
    its kernel wait channel, its Python stack)."""
    try:
        return holder.wait(HANG_S)
    except subprocess.TimeoutExpired:
        status = _proc_text(holder.pid, "status").splitlines()
        state = [line for line in status if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn"))]
        wchan = _proc_text(holder.pid, "wchan")
        holder.send_signal(signal.SIGUSR1)
        time.sleep(2)
        holder.kill()
        holder.wait()
        stack = "\n".join(p.read_text()[-4000:] for p in tmp_path.glob("hold.*.err"))
        pytest.fail(f"hold.py still running {HANG_S} s after the signal: {state} wchan={wchan}\n{stack}")
    finally:
        holder.stdout.close()


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text()
    except OSError as err:   # it ended meanwhile
        return str(err)


def _run_namespaces(pid: int) -> set[str]:
    return {n for n in _netns_list() if n.startswith(f"{PREFIX}-{pid}-")}


def test_teardown_on_signals_and_stale_cleanup(tmp_path):
    """A run killed by SIGTERM or Ctrl-C removes its namespaces and its processes in them; a run
    SIGKILLed (nothing runs) leaves them, and the next run removes those before starting."""
    # Every wait below is a hang guard only, far above the time it takes on a loaded 2-core box (a
    # teardown runs several `ip` commands and waits for processes: under 1 s at load 15); hold.py
    # outlives every guard, so a signal it did not act on fails here with its state, not as a wait.
    for sig, code in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT),
                      (signal.SIGKILL, -signal.SIGKILL)):
        holder = _hold(tmp_path)
        try:
            info = _held(holder)
        finally:
            holder.send_signal(sig)
            assert _ended(holder, tmp_path) == code, sig
        if sig != signal.SIGKILL:
            assert not set(info["names"]) & _netns_list(), sig
            assert not pid_alive(info["pid"]), f"process in the namespace survived {sig!r}"
    # the SIGKILLed run left its namespaces and its sleep; a new run cleans both up first
    assert set(info["names"]) <= _netns_list()
    with NetnsCluster(1) as box:
        assert not set(info["names"]) & _netns_list()
        assert not pid_alive(info["pid"])  # killed (a zombie at most, until init reaps it)
        assert all(n.startswith(f"{PREFIX}-") for n in box.names)


def test_a_second_signal_during_teardown_waits_for_it(tmp_path):
    """Ctrl-C pressed again while a SIGTERMed run tears down (delivered at a fixed point of stop:
    before the namespaces are deleted) does not cut the teardown short, and still ends the run."""
    holder = _hold(tmp_path, "second-signal-in-stop")
    try:
        info = _held(holder)
    finally:
        holder.send_signal(signal.SIGTERM)
        code = _ended(holder, tmp_path)
    assert not set(info["names"]) & _netns_list()
    assert not pid_alive(info["pid"])
    assert code == -signal.SIGINT, (code, (tmp_path / "hold.second-signal-in-stop.err").read_text()[-3000:])


def test_a_signal_just_after_a_namespace_is_made_leaves_none(tmp_path):
    """SIGTERM arriving in start() right after `ip netns add` made node 1's namespace (before
    start() returns) ends the run with every namespace it made deleted, that one too."""
    holder = _hold(tmp_path, "signal-after-netns-add")
    assert _ended(holder, tmp_path) == 128 + signal.SIGTERM
    assert not _run_namespaces(holder.pid), _run_namespaces(holder.pid)


# --------------------------------------------------------------------------------------- Ray

def test_ray_actor_reports_its_own_nodes_address(ray_box):
    """An actor Ray places on the rollout node (by its node resource) and one on trainer node B
    (by Ray's node:IP resource) report those nodes' addresses, and live in those namespaces."""
    box = ray_box.cluster
    seen = _driver(ray_box, "addresses", {"resources": ["megarl_rollout", f"node:{box.address(TRAIN_B)}"]})
    rollout, train_b = seen["actors"]["megarl_rollout"], seen["actors"][f"node:{box.address(TRAIN_B)}"]
    assert rollout["ray_ip"] == rollout["megarl_address"] == box.address(ROLLOUT), rollout
    assert train_b["ray_ip"] == train_b["megarl_address"] == box.address(TRAIN_B), train_b
    assert box.node_of_netns(rollout["netns"]) == ROLLOUT and box.node_of_netns(train_b["netns"]) == TRAIN_B
    assert seen["driver"]["megarl_address"] == box.address(TRAIN_A), seen["driver"]
    assert box.node_of_netns(seen["driver"]["netns"]) == TRAIN_A


def test_disaggregated_pools_land_on_their_nodes(ray_box):
    """plan_pools + create_placement_groups of a disaggregated GPU run (fake GPUs): the actor pool's
    bundles on the two megarl_train nodes, the rollout pool's on the megarl_rollout node; a pool
    that the marked nodes cannot hold fails at once with a one-line reason."""
    box = ray_box.cluster
    placed = _driver(ray_box, "placement", {"overrides": [
        "cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.nodes=3", "actor.gpus=2", "rollout.gpus=1"]})
    actor_nodes = sorted(box.node_of_netns(p["netns"]) for p in placed["actor"])
    assert actor_nodes == [TRAIN_A, TRAIN_B], placed["actor"]
    assert sorted(p["ray_ip"] for p in placed["actor"]) == [box.address(TRAIN_A), box.address(TRAIN_B)]
    (rollout,) = placed["rollout"]
    assert box.node_of_netns(rollout["netns"]) == ROLLOUT and rollout["ray_ip"] == box.address(ROLLOUT)
    # the recipe asks for a critic on a 4th GPU node, but the Ray cluster marks only two trainer nodes
    refused = _driver(ray_box, "placement", {"overrides": [
        "cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.nodes=4", "actor.gpus=2", "rollout.gpus=1",
        "critic.enabled=true", "critic.gpus=1", "algorithm.advantage=gae"]})
    assert refused == {"error": "pools 'actor' (2) + 'critic' (1) need 3 bundle(s) on nodes with resource "
                                "'megarl_train'; the cluster's megarl_train nodes offer 2"}, refused


def test_worker_group_rendezvous_spans_two_nodes(ray_box, tmp_path_factory):
    """A TP2 actor WorkerGroup placed by megarl over two trainer nodes: rank 0's node address is the
    torch.distributed master both ranks dial, gloo binds the bridge interface, and a TP2 forward
    across the two namespaces matches HF transformers; the rollout bundle is on the rollout node."""
    from tests.helpers.runs import tiny_model

    box = ray_box.cluster
    model = tiny_model(tmp_path_factory.mktemp("cluster_box_model"))
    t0 = time.time()
    out = _driver(ray_box, "worker_group", {"model": str(model)}, timeout=420)
    print(f"\n[cluster-box] TP2 worker group across namespaces: {time.time() - t0:.1f}s")
    ranks = sorted(out["ranks"], key=lambda r: r["rank"])
    nodes = [box.node_of_netns(r["netns"]) for r in ranks]
    assert sorted(nodes) == [TRAIN_A, TRAIN_B], (nodes, ranks)
    for r, node in zip(ranks, nodes):
        assert r["ray_ip"] == box.address(node), r
        assert r["master_addr"] == box.address(nodes[0]), r   # rank 0's node, dialled by both
        assert r["gloo_ifname"] == "eth0", r
        assert r["topology"]["tp_rank"] == r["rank"] and r["world"] == 2
    assert ranks[0]["master_port"] == ranks[1]["master_port"]
    assert out["logprob_max_abs_diff"] < 1e-4, out["logprob_max_abs_diff"]
    assert box.node_of_netns(out["rollout_bundle"]["netns"]) == ROLLOUT
