"""Packaging: imports without frameworks, clear messages, the Dockerfile runs the CI install."""
import re
import subprocess
import sys

from harness import ROOT


def _py(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)


def test_core_imports_without_any_framework():
    r = _py("import sys; sys.modules['torch'] = None; sys.modules['tensorflow'] = None\n"
            "import horovod_sbc, horovod_sbc.wire, horovod_sbc.reference, horovod_sbc.residual\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print('ok')")
    assert r.stdout.strip() == "ok", r.stderr


def test_adapters_without_their_framework_say_what_to_install():
    r = _py("import sys; sys.modules['torch'] = None\nimport horovod_sbc.torch")
    assert r.returncode != 0 and "pip install 'horovod_sbc[torch]'" in r.stderr
    r = _py("import sys; sys.modules['tensorflow'] = None\nimport horovod_sbc.tensorflow")
    assert r.returncode != 0 and "pip install 'horovod_sbc[tensorflow]'" in r.stderr


def test_dockerfile_and_ci_use_the_same_install_path():
    docker = (ROOT / "Dockerfile").read_text()
    assert re.search(r"bash scripts/install\.sh", docker)
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in docker
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^install:\n\tbash scripts/install\.sh", make, re.M)
    assert re.search(r"^test: install\n", make, re.M) and re.search(r"^demo: install\n", make, re.M)
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_install_is_idempotent_and_fast_when_nothing_changed():
    r = subprocess.run(["bash", "scripts/install.sh"], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout


def test_the_package_imports_one_way_without_circles():
    r = subprocess.run([sys.executable, "scripts/import_graph.py"], capture_output=True,
                       text=True, cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("no circles, no upward imports")
    # the layers of ARCHITECTURE.md hold what they say (a few anchors)
    assert "horovod_sbc.wire -> -" in r.stdout and "horovod_sbc.protocol -> wire" in r.stdout


def test_import_graph_catches_a_circle_and_an_upward_import(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph as ig
    finally:
        sys.path.pop(0)
    graph = {"wire": {"protocol"}, "protocol": {"wire"}, "torch.sync": {"torch.compressor"},
             "torch.compressor": set()}
    assert ig.cycles(graph) == [["protocol", "wire"]]
    ups = ig.upward(graph)
    assert any(u.startswith("wire (format) imports protocol") for u in ups)
    assert any(u.startswith("torch.sync (sync) imports torch.compressor") for u in ups)


def test_tests_do_not_import_benchmarks_to_run_jobs():
    src = (ROOT / "tests" / "harness.py").read_text()
    assert not [line for line in src.splitlines()
                if line.lstrip().startswith(("import", "from")) and "benchmarks" in line]
