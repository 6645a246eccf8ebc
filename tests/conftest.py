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
