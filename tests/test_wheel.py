"""The wheel is complete: installed into a fresh virtualenv, away from the source tree, it builds its
compiled kernels from its own files and generates with them.

Offline and quick: the wheel is built without build isolation (setuptools from this virtualenv), the
new virtualenv has no pip of its own (this one's pip installs into it) and sees torch and the other
runtime dependencies through a ``.pth`` line naming this virtualenv's site-packages (only that
directory: the editable install's hooks there are not run), and the kernels are built into a
temporary cache (``MSTAR_KERNEL_DIR``). Only the core extension is built: llama-tiny uses no other,
and every extension's build is tested in tests/test_cpu_ops.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# run by the new virtualenv's interpreter, from a directory outside the repository
_PROBE = r"""
import json, os, sys
from pathlib import Path

import torch

import mstar
import mstar.layers.cpu_ops as cpu_ops
from mstar.layers.prepack import prepack_mode
from mstar.runtime.api import Runtime

cpu_ops.build()
ext = cpu_ops.ops()
used = set()

class Recording:
    def __getattr__(self, name):
        used.add(name)
        return getattr(ext, name)

cpu_ops._EXTENSION._state["module"] = Recording()
with Runtime("llama-tiny") as rt:
    out = rt.generate([{"input_ids": torch.tensor([1, 5, 9, 14])}], {"max_tokens": 6, "sampling": {"temperature": 0}})
print(json.dumps({"package": mstar.__file__, "kernel": ext.__file__, "prepack": prepack_mode(),
                  "sources": sorted(p.name for p in Path(cpu_ops.__file__).with_name("csrc").iterdir()),
                  "tokens": [int(t) for t in out[0].tensors("token")], "used": sorted(used),
                  "sys_path_has_repo": any(Path(p or ".").resolve() == Path(os.environ["REPO"]) for p in sys.path)}))
"""


def test_installed_wheel_builds_its_kernels_and_generates(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist)], cwd=ROOT, check=True)
    (wheel,) = dist.glob("mstar-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_mstar_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True)

    work = tmp_path / "elsewhere"
    work.mkdir()
    cache = tmp_path / "kernels"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSTAR_KERNELS", "MSTAR_PREPACK")}
    env.update(MSTAR_KERNEL_DIR=str(cache), REPO=str(ROOT))
    run = subprocess.run([str(py), "-c", _PROBE], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])

    assert Path(got["package"]).resolve().is_relative_to(site.resolve())  # the installed copy, not the repo
    assert not got["sys_path_has_repo"]
    assert Path(got["kernel"]).resolve().is_relative_to(cache.resolve())  # built here from the wheel's files
    expected = {p.name for p in (ROOT / "mstar" / "layers" / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert expected <= set(got["sources"])  # every source and header shipped
    omni = site / "mstar" / "models" / "qwen3_omni" / "csrc"
    assert {p.name for p in omni.iterdir()} == {p.name for p in (ROOT / "mstar" / "models" / "qwen3_omni" / "csrc").iterdir()}
    assert got["prepack"] == "panel" and "linear" in got["used"]  # the generate ran on the kernels
    assert len(got["tokens"]) == 6
