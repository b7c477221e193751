#!/usr/bin/env python3
"""Imports every `turbine.*` module on this host's vLLM and says which fail, and why.

The first thing to run on a GPU host after installing the bundle (benchmarks/gpu/gpu_install.sh): a vLLM
name the GPU release lacks breaks the worker at import, and CI, which has the CPU build only, cannot
see it (tests/vllm_releases.py checks the names statically; this checks the real thing: native
libraries, torch, CUDA). Every module is imported in this one process, in name order; a failure is
recorded with the innermost frame that raised, and the sweep goes on. Exit status 1 if any failed.

    PYTHONPATH=/tmp/h8/site:. python3 scripts/import_sweep.py --out $OUT/import_sweep.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: str = "turbine") -> list[str]:
    root = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, prefix=f"{package}.")]
    return sorted(names)


def sweep(names: list[str]) -> list[dict]:
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
            error = None
        except BaseException as exc:  # SystemExit from a module is a failure like any other
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            error = {"type": type(exc).__name__, "message": str(exc)[:500],
                     "at": f"{frame.filename}:{frame.lineno}" if frame else None}
        results.append({"module": name, "seconds": round(time.perf_counter() - start, 3), "error": error})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="turbine")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's turbine
        sys.path.insert(0, str(ROOT))
    results = sweep(modules(args.package))
    failed = [r for r in results if r["error"]]
    versions = {}
    for dist in ("vllm", "torch", "nixl"):
        try:
            versions[dist] = importlib.import_module(dist).__version__
        except Exception:
            versions[dist] = None
    for r in failed:
        e = r["error"]
        print(f"FAIL {r['module']}: {e['type']}: {e['message']} ({e['at']})")
    print(f"{len(results) - len(failed)}/{len(results)} turbine modules import "
          f"(vllm {versions['vllm']}, torch {versions['torch']}, nixl {versions['nixl']})")
    if args.out:
        args.out.write_text(json.dumps({"versions": versions, "modules": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
