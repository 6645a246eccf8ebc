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
            "import horovod_sbc, horovod_sbc.wire, horovod_sbc.core, horovod_sbc.residual\n"
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
