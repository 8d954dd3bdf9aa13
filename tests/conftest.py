"""Shared test setup: offline hubs, few threads (CI has 2 cores), and a tmp run directory."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest


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
