import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


def _cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``SBC_TEST_LOG=<file>``: one JSON line per test (wall, this process's CPU, its
    children's CPU, setup included), to see where the suite's time goes."""
    path = os.environ.get("SBC_TEST_LOG")
    t0, (own0, kids0) = time.monotonic(), _cpu()
    yield
    if path:
        own, kids = _cpu()
        with open(path, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - t0, 2),
                                "cpu": round(own - own0, 2), "kids": round(kids - kids0, 2)})
                    + "\n")


#: test files that start jobs, clusters or installs without the ``multirank`` marker
_JOB_FILES = {"test_slurm.py", "test_package.py"}
#: job files whose jobs take about one core or less (two small ranks, or ranks that mostly
#: wait: their children's CPU time about their wall time, ``SBC_TEST_LOG``): a second lane of
#: jobs, beside the single-process tests, while the heavy jobs keep the first
_LIGHT_JOB_FILES = {"test_slurm.py", "test_package.py", "test_bench.py", "test_hierarchy.py",
                    "test_bench_ddp.py", "test_outer_ranks.py", "test_fixed_size.py",
                    "test_example_lm.py", "test_oneline.py", "test_fused.py",
                    "test_tf_elastic.py", "test_gpu_check.py", "test_patterns.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups
def pytest_collection_modifyitems(config, items):
    """``scripts/test.sh`` runs the suite on 2 pytest-xdist workers (``--dist loadgroup``): the
    tests that start multi-process jobs stay together on one worker, in file order (their
    shared jobs are started once per process, and two heavy jobs at a time would fight for
    the cores and the timeouts), while the single-process tests fill the other core. The jobs
    of :data:`_LIGHT_JOB_FILES` (about one core each) form a second group, which the other
    worker takes beside the single-process tests: the heavy jobs use about 1.3 cores on
    average, and alone they were the suite's wall time. A job whose ranks mostly sleep once
    started (``waits``: the hang and timeout tests) runs on any worker."""
    for item in items:
        if (item.get_closest_marker("multirank") or item.path.name in _JOB_FILES) and \
                not item.get_closest_marker("waits"):
            light = item.path.name in _LIGHT_JOB_FILES
            item.add_marker(pytest.mark.xdist_group("jobs-light" if light else "jobs"))


def pytest_configure(config):
    """Refuse, with the reason, a pytest that breaks ``--dist loadgroup``: from pytest 9.2 on,
    pytest-xdist (3.8.0 and before) no longer suffixes the grouped node ids
    (pytest-dev/pytest-xdist#1386), so the job tests would be spread over both workers and two
    multi-rank jobs would run at once on 2 cores (twice the time, timeouts)."""
    if config.getoption("dist", None) != "loadgroup":
        return
    from importlib.metadata import version
    from packaging.version import Version
    if Version(pytest.__version__) >= Version("9.2") and \
            Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')}: "
            "--dist loadgroup does not group tests (pytest-dev/pytest-xdist#1386); `make "
            "install` installs the pinned pytest<9.2")
