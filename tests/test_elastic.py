"""Elastic Horovod with SBC (``horovod_sbc.torch.elastic.SBCState``) on one real ``horovodrun``
elastic job on localhost (Gloo): 3 ranks shrink to 2, grow to 3 again, and then the third rank
dies inside a drop-in sync and its host is blacklisted; the job ends on 2 ranks. The stock
optimizer (adopted by ``SBCState``: it exchanges weight changes with the residual in the weights,
as the drop-in does) exchanges by the sparse reduce-scatter (``SBC(topology="reduce_scatter")``),
whose downlink residuals survivors keep and new workers start at zero.

The discovery script is a file this test rewrites whenever rank 0 reports that it waits for a
host change ("localhost" holds 2 slots; "127.0.0.1", a second name for this machine, is the
host that comes and goes: Horovod blacklists a failed worker's whole host). Every reset is
checked: the shared weights agree on every rank, survivors keep their residuals and delay-window
position (digests equal to those of their last commit), new workers start with a zero residual,
SBC's world records follow the world, the losses keep falling and the job finishes with
identical weights. Worker: tests/workers/torch_elastic.py."""
import json
import os
import sys
import tempfile

import pytest

from harness import ROOT, WORKERS, launch

pytestmark = pytest.mark.multirank
TIMEOUT = 300  # a hang fails; the job takes 2-3 min on 2 cores under load from other jobs
THREE, TWO = ["localhost:2", "127.0.0.1:1"], ["localhost:2"]
HOSTS = {"shrink": TWO, "grow": THREE}
#: (step, world size) of each start of the training function before the kill, in order
ENTRIES = [(0, 3), (8, 2), (16, 3)]
KILL = 24


def write_discovery(path: str, hosts) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts))
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)  # the driver never runs a half-written script


def run_elastic_job(worker: str, args, timeout: float, prefix: str):
    """``tests/workers/<worker>`` as a real elastic ``horovodrun`` job on localhost (Gloo):
    3 ranks whose discovery script is rewritten to ``HOSTS[name]`` whenever rank 0 prints a
    ``ready`` event; returns (the ``EL {json}`` events in order, the output)."""
    script = os.path.join(tempfile.mkdtemp(prefix=prefix), "discover.sh")
    write_discovery(script, THREE)
    events = []

    def on_line(line):
        if "EL {" not in line:
            return
        ev = json.loads(line[line.index("EL {") + 3:])
        events.append(ev)
        if ev["ev"] == "ready":
            write_discovery(script, HOSTS[ev["name"]])

    hr = str(launch.BIN / "horovodrun")
    cmd = [hr, "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", script,
           "--gloo", "--network-interface", "lo", sys.executable, str(WORKERS / worker), *args]
    # HOROVOD_GLOO_TIMEOUT_SECONDS (30 s) bounds both how long the survivors wait for a new
    # worker to start (a shorter one fails the grow on a loaded machine) and how long rank 0,
    # Gloo's coordinator, waits on the dead peer after the kill
    env = launch.job_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    try:
        rc, out = launch.run(cmd, timeout, env, on_line=on_line)
    except launch.JobTimeout as e:
        pytest.fail(f"elastic job did not finish within {timeout} s\n{e.output[-6000:]}")
    assert rc == 0, out[-6000:]
    return events, out


@pytest.fixture(scope="module")
def job():
    return run_elastic_job("torch_elastic.py", ["stock_topology=reduce_scatter"], TIMEOUT,
                           "sbc-elastic-")


def groups(events):
    """The ``entry`` events split by reset, each a list of one event per rank."""
    out, cur = [], []
    for ev in (e for e in events if e["ev"] == "entry"):
        if cur and (ev["size"] != cur[0]["size"] or ev["step"] != cur[0]["step"]
                    or len(cur) == cur[0]["size"]):
            out.append(cur)
            cur = []
        cur.append(ev)
    return out + [cur] if cur else out


def test_the_job_grows_shrinks_survives_a_kill_and_ends_with_identical_weights(job):
    events, _ = job
    gs = groups(events)
    assert [(g[0]["step"], g[0]["size"]) for g in gs][:3] == ENTRIES
    assert len(gs) == 4 and gs[3][0]["size"] == 2 and gs[3][0]["step"] >= KILL, \
        [(g[0]["step"], g[0]["size"]) for g in gs]
    for g in gs:
        assert sorted(e["rank"] for e in g) == list(range(g[0]["size"]))
    kill = [e for e in events if e["ev"] == "kill"]
    assert len(kill) == 1 and kill[0]["host"] == "127.0.0.1"
    done = [e for e in events if e["ev"] == "done"]
    assert len(done) == 2 and {e["size"] for e in done} == {2}
    assert {e["host"] for e in done} == {"localhost"}
    assert done[0]["weights"] == done[1]["weights"]  # finish(): one model on every rank
    assert done[0]["stock_w"] == done[1]["stock_w"]
    assert all(os.path.dirname(e["pkg"]) == str(ROOT / "horovod_sbc") for e in gs[0])


def test_every_reset_agrees_on_the_shared_weights_and_renews_the_world(job):
    for g in groups(job[0]):
        assert len({e["wref"] for e in g}) == 1, g
        assert len({e["stock_w"] for e in g}) == 1, g
        assert len({e["local_steps"] for e in g}) == 1, g
        for e in g:  # SBC's world records: (size, rank) of both compressors
            assert e["world"] == [e["size"], e["rank"]] * 2, e


def test_survivors_keep_their_residuals_and_new_workers_start_from_zero(job):
    gs = groups(job[0])
    seen, survivors, newcomers = set(), 0, 0
    for i, g in enumerate(gs):
        for e in g:
            if e["wid"] in seen:  # a survivor: exactly its last committed state
                survivors += 1
                assert e["last"] is not None
                for k in ("wref", "res", "weights", "stock_w", "stock_res", "stock_weights",
                          "stock_down", "local_steps"):
                    assert e[k] == e["last"][k], (i, k, e)
                assert e["res_max"] > 0 and e["stock_res_max"] > 0  # a residual to keep
                assert e["stock_down_max"] > 0  # every rank owns a region
            else:  # a new worker: the shared weights, a zero residual (up and down)
                newcomers += 1
                assert e["last"] is None and e["res_max"] == 0 and e["stock_res_max"] == 0, e
                assert e["stock_down_max"] == 0, e
                assert e["weights"] == e["wref"] and e["stock_weights"] == e["stock_w"]
                assert e["stats"][0]["syncs"] == 0 and e["stats"][1]["syncs"] == 0
        seen |= {e["wid"] for e in g}
    # 3 at the start, 1 at the grow; survivors: 2 + 2 + 2 after the three resets
    assert (newcomers, survivors) == (4, 6)
    # the survivors' residuals differ (each rank keeps its own, none is rank 0's)
    for g in gs[1:]:
        old = [e for e in g if e["last"] is not None]
        assert len({e["res"] for e in old}) == len(old)


def test_a_sync_a_dying_peer_interrupts_commits_nothing(job):
    fails = [e for e in job[0] if e["ev"] == "fail"]
    assert len(fails) == 2 and {e["host"] for e in fails} == {"localhost"}, fails
    for e in fails:
        assert e["unchanged"], e
        assert e["before"]["res_max"] > 0


def test_the_loss_keeps_falling(job):
    events = job[0]
    ready = [e["loss"] for e in events if e["ev"] == "ready"]
    done = [e["loss"] for e in events if e["ev"] == "done"]
    assert len(ready) == 2 and len(done) == 2
    for k in (0, 1):  # drop-in (shared weights), stock hook
        seq = [loss[k] for loss in ready] + [done[0][k]]
        assert all(b < a for a, b in zip(seq, seq[1:])), (k, seq)
        assert seq[-1] < 0.5 * seq[0], (k, seq)
