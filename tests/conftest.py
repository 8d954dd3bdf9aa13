"""Shared test setup: offline hubs, few threads (CI has 2 cores), and a tmp run directory."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels (the engine's decode step, tests/test_decode_kernels.py) run under
# Triton's interpreter; it must be on before anything imports triton (transformers may, early).
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


import multiprocessing

import pytest

# The session's forkserver -- spawn's ranks once this process holds threads or has imported Ray, the
# reward pool's process workers -- imports megatron once when it starts, whichever starts it first,
# so its children do not import it each (megarl/parallel/preload.py).
multiprocessing.set_forkserver_preload(["megarl.parallel.preload"])

# Test tiers (pytest -m unit | integration | e2e; ARCHITECTURE.md, "Tests"). A file's tier is its
# heaviest common case; a test marked with a tier itself keeps its own.
#   unit:        pure functions and in-process objects, seconds
#   integration: real servers, Ray, torch.distributed ranks, SGLang's own code, sandboxes
#   e2e:         whole runs (Trainer.run, `megarl train`), SLURM, network-namespace clusters
TIERS = ("unit", "integration", "e2e")
UNIT_FILES = {
    "test_algos_advantages.py", "test_algos_kl_filters.py", "test_algos_losses.py", "test_architecture.py",
    "test_client_fields.py", "test_coalesce.py", "test_config.py", "test_data_rewards.py", "test_reward_pool.py",
    "test_ledger.py",
    "test_distill_algos.py",
    "test_rollout_source.py", "test_sampling.py", "test_sync_buckets.py",
}
E2E_FILES = {
    "test_agent_train.py", "test_cluster_box.py", "test_cluster_train.py", "test_healing.py", "test_reward_model.py",
    "test_rollout_modes.py", "test_slurm.py", "test_trainer.py", "test_trainer_moe.py", "test_lora_train.py",
    "test_distill_train.py", "test_checkpoint_faults.py",
}


def tier_of_file(name: str) -> str:
    return "unit" if name in UNIT_FILES else "e2e" if name in E2E_FILES else "integration"


def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier marker: its own, or its file's."""
    for item in items:
        own = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(set(own)) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one test tier marker {sorted(set(own))}")
        if not own:
            item.add_marker(getattr(pytest.mark, tier_of_file(item.path.name)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On CI every dependency is installed by .ci/run, so a skipped test means a broken set-up:
    report it as a failure instead of letting it pass silently."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI (a missing dependency?): {report.longrepr}"


@pytest.fixture
def netns_cluster():
    """Factory of fake nodes (tests/netns_cluster.py): ``netns_cluster(n)`` returns a started
    NetnsCluster of ``n`` network namespaces, torn down after the test (also when it fails)."""
    from tests.netns_cluster import NetnsCluster, netns_available

    why = netns_available()
    if why:
        pytest.skip(why)
    made = []

    def make(nodes: int, **kw):
        made.append(NetnsCluster(nodes, **kw).start())
        return made[-1]

    try:
        yield make
    finally:
        for box in made:
            box.stop()


def pytest_unconfigure(config):
    """A test run that has printed its summary must also end: something a test left running (a
    hung worker a pool joins at exit, a non-daemon thread) would otherwise hold the process open
    until CI's limit without a word. Past 120 s of exit, every thread's stack is printed and the
    process ends with status 1."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
