"""``workers="ray"`` on a local two-node Ray cluster (``ray.cluster_utils.Cluster``: two raylets on
127.0.0.1 pinned by the custom resources ``mstar_node_a`` / ``mstar_node_b``). Every output equals
one rank's; ranks on the other node are reached over TCP; a killed actor fails requests as
WORKER_LOST; nothing (Ray process, shm file, placement group, actor) is left behind.

Ray finds its node address by probing outside hosts, so these tests run only inside a loopback-only
network namespace (``make test`` runs them with ``unshare -n``); elsewhere they are skipped.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.model.registry import resolve_model
from mstar.placement import Placement
from mstar.runtime.failures import FailureKind
from mstar.runtime.wire.transport import SHM_DIR
from mstar.server.errors import STATUS_OF_FAILURE
from tests.helpers import kv_blocks_in_use

ROOT = Path(__file__).resolve().parents[1]
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mstar[ray]')")


def _loopback_only() -> bool:
    """Whether this process's network namespace has no interface but ``lo`` (/proc/net/dev is per
    namespace; /sys/class/net is not remounted by ``unshare -n``)."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


if not _loopback_only():
    pytest.skip("Ray tests run inside a loopback-only network namespace (make test starts them with "
                "unshare -n)", allow_module_level=True)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# MSTAR_KERNELS: every process of the test (this one and each actor) on the PyTorch paths, so no
# actor pays the compiled kernels' first load (tests/test_cpu_ops.py and test_paged_decode_kernel.py cover them)
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "MSTAR_KERNELS": "torch",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
TWO_NODES = [{"name": "a", "ranks": [0]}, {"name": "b", "ranks": [1]}]


@pytest.fixture(scope="module")
def cluster():
    """Head node 'a' and node 'b', under a temporary directory of their own; afterwards no process
    started for the cluster (its command line names that directory) may remain."""
    from ray.cluster_utils import Cluster

    ray_dir = Path(tempfile.mkdtemp(prefix="mstar-ray-"))  # short: Ray's socket paths live under it
    env = {**ENV, "RAY_TMPDIR": str(ray_dir)}  # every file Ray writes goes under ray_dir
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the raylets and their workers inherit it (actors import this tree)
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 128 << 20}
    c = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 2, "include_dashboard": False,
                                                      "resources": {"mstar_node_a": 1}})
    c.add_node(**node, num_cpus=2, resources={"mstar_node_b": 1})
    c.wait_for_nodes()
    ray.init(address=c.address)
    # the leak check below finds Ray's processes by that directory: it must see them while they run
    assert [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, str(ray_dir))]
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, str(ray_dir))]
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, f"Ray processes left behind: {left}"


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _assert_released(rt: Runtime, run_id: str, pg_id: str, names: list[str]) -> None:
    """After shutdown: placement group removed, actors gone, no shm file of the run."""
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    for name in names:
        with pytest.raises(ValueError):
            ray.get_actor(name)
    if SHM_DIR:
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(run_id)]


def _run_on_ray(model, placement: dict, inputs: list, params: dict, then=None) -> tuple[list, dict[int, str]]:
    """Generate on Ray, check what the run used and left; ``then(rt)`` runs before the shutdown."""
    rt = Runtime(model, Placement.from_dict(placement), workers="ray").start()
    driver = rt._driver
    run_id, pg_id = driver.transport.shm_prefix, driver._pg.id.hex()
    names = [f"{run_id}-rank{r}" for r in driver.actors]
    try:
        outs = rt.generate(inputs, params)
        assert all(o.finished for o in outs), [o.error for o in outs]
        assert kv_blocks_in_use(rt) == 0
        nodes = dict(driver.rank_nodes)
        links, conductor_node = driver.transport.links, driver.transport.node_id
        if then is not None:
            then(rt)
    finally:
        rt.shutdown()
    _assert_released(rt, run_id, pg_id, names)
    by_node = {}
    for rank, node_id in sorted(nodes.items()):
        by_node.setdefault(node_id, []).append(rank)
    assert sorted(links) == sorted(nodes)
    for rank, address in links.items():  # IPC to the conductor's own Ray node, TCP to the other
        assert address.startswith("ipc://" if nodes[rank] == conductor_node else "tcp://127.0.0.1:"), (rank, address)
    assert len(by_node) == 1 or any(a.startswith("tcp://") for a in links.values())
    return outs, by_node


def test_placement_group_that_cannot_be_placed_fails_clearly(cluster):
    placement = {"model": "bagel", "nodes": [{"name": n, "ranks": [i]} for i, n in enumerate("abc")],
                 **Placement.load(ROOT / "examples/placements/bagel_cfg_parallel.yaml").to_dict()}
    with pytest.raises(RuntimeError, match=r"not placed in 3 s: 3 bundle\(s\) on distinct Ray nodes: the "
                                           r"cluster has 2 live node\(s\)"):
        Runtime("bagel-tiny", Placement.from_dict(placement), workers="ray", start_timeout=3).start()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_llama_prefill_and_decode_on_two_nodes_then_a_killed_actor(cluster):
    model = resolve_model("llama-tiny")
    prompts = [[1, 17, 33, 100, 7], [1, 45], [1, 200, 23, 5, 61, 88, 19, 250, 3]]
    params = {"max_tokens": 24, "sampling": {"temperature": 0.0, "ignore_eos": True}}
    inputs = [{"input_ids": torch.tensor(p)} for p in prompts]
    with Runtime(model) as rt:
        single = [o.tensors("text") for o in rt.generate(inputs, params)]
    pd = {"model": "llama-tiny", "nodes": TWO_NODES, "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]}
    outs, by_node = _run_on_ray(model, pd, inputs, params, then=lambda rt: _kill_rank_1(rt, inputs[0], params))
    assert sorted(by_node.values()) == [[0], [1]]  # two Ray nodes
    for o, ref in zip(outs, single):
        assert [int(t) for t in o.tensors("text")] == [int(t) for t in ref]


def _kill_rank_1(rt: Runtime, inputs: dict, params: dict) -> None:
    with rt.held():  # the request is dispatched only after rank 1 is dead
        h = rt.submit(inputs, params)
        ray.kill(rt._driver.actors[1])
        ray.wait([r for r, rank in rt._driver._runs.items() if rank == 1], timeout=60)
    out = h.result(timeout=60)
    assert out.status is RequestStatus.FAILED and out.failure is FailureKind.WORKER_LOST, out.error
    assert STATUS_OF_FAILURE[out.failure] == 503 and "worker rank 1 died" in out.error
    assert not rt.healthy and "worker rank 1 died" in rt.fatal
    with pytest.raises(RuntimeError, match="unhealthy"):
        rt.submit(inputs, params)


def test_without_nodes_every_rank_shares_one_ray_node(cluster):
    model = resolve_model("llama-tiny")
    inputs = [{"input_ids": torch.tensor([1, 17, 33, 100, 7])}]
    params = {"max_tokens": 12, "sampling": {"temperature": 0.0, "ignore_eos": True}}
    with Runtime(model) as rt:
        single = [int(t) for t in rt.generate(inputs, params)[0].tensors("text")]
    pd = {"model": "llama-tiny", "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]}
    outs, by_node = _run_on_ray(model, pd, inputs, params)
    assert list(by_node.values()) == [[0, 1]]  # one bundle: one Ray node
    assert [int(t) for t in outs[0].tensors("text")] == single


def test_orpheus_codec_on_the_other_node(cluster):
    model = resolve_model("orpheus-tiny")
    from tests.test_orpheus import PROMPTS

    inputs = [{"input_ids": torch.tensor(p)} for p in PROMPTS[:2]]
    params = {"max_tokens": 60, "sampling": {"seed": 3}}
    with Runtime(model) as rt:
        single = rt.generate(inputs, params)
    placement = {"model": "orpheus-tiny", "nodes": TWO_NODES, "node_groups": [
        {"node_names": ["LLM"], "ranks": [0]}, {"node_names": ["snac_decoder"], "ranks": [1]}]}
    outs, by_node = _run_on_ray(model, placement, inputs, params)
    assert sorted(by_node.values()) == [[0], [1]]
    for o, ref in zip(outs, single):
        assert [int(t) for t in o.tensors("token")] == [int(t) for t in ref.tensors("token")]
        assert ref.tensors("audio")
        torch.testing.assert_close(torch.cat(o.tensors("audio")), torch.cat(ref.tensors("audio")), rtol=0, atol=0)


def test_bagel_cfg_views_on_the_other_node(cluster):
    from tests.test_bagel_model import image, latents, text

    model = resolve_model("bagel-tiny")
    inputs = [{"text_ids": [text("edit me")], "images": [image(11)]}]
    params = {"target": "image", "seed": 4, "num_timesteps": 4, "output_type": "latent"}
    with Runtime(model) as rt:
        single = latents(rt.generate(inputs, params)[0])
    placement = {**Placement.load(ROOT / "examples/placements/bagel_cfg_parallel.yaml").to_dict(),
                 "nodes": [{"name": "a", "ranks": [0]}, {"name": "b", "ranks": [1, 2]}]}
    outs, by_node = _run_on_ray(model, placement, inputs, params)
    assert sorted(by_node.values()) == [[0], [1, 2]]  # both guidance views share node 'b'
    torch.testing.assert_close(latents(outs[0]), single, rtol=0, atol=1e-5)


def test_mstar_serve_with_ray_workers(cluster, tmp_path):
    """``mstar serve --workers ray --ray-address``: a chat request answered by ranks on both nodes, then
    SIGTERM: exit 0, the run's placement group removed."""
    import httpx

    from tests.server_utils import free_port

    config = tmp_path / "pd.yaml"
    config.write_text("model: llama-tiny\nnodes:\n  - {name: a, ranks: [0]}\n  - {name: b, ranks: [1]}\n"
                      "node_groups:\n  - {node_names: [LLM], ranks: [0], graph_walks: [prefill]}\n"
                      "  - {node_names: [LLM], ranks: [1], graph_walks: [decode]}\n")
    port = free_port()
    before = set(ray.util.placement_group_table())
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", "llama-tiny", "--config", str(config),
                             "--workers", "ray", "--ray-address", cluster.address, "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard = threading.Timer(180, proc.kill)  # a hung server fails the test instead of hanging it
    guard.start()
    try:
        lines = []
        for line in proc.stdout:  # uvicorn says so once its socket is bound
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        assert proc.poll() is None, "".join(lines)
        assert any("2 rank(s) on 2 node(s)" in line for line in lines), "".join(lines)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + out
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    table = ray.util.placement_group_table()
    new = set(table) - before
    assert new and all(table[pg]["state"] == "REMOVED" for pg in new)
