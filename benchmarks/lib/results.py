"""The result files: JSON laid out for reading, and the commit it was measured on."""

from __future__ import annotations

import json
import os
import re
import subprocess

from benchmarks.lib.paths import REPO_ROOT


def dump_json(obj) -> str:
    """Indented JSON with every innermost list on one line (the per-request table stays compact)."""
    text = json.dumps(obj, indent=1, default=str)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def git_commit() -> str | None:
    """The commit a result came from: $TURBINE_COMMIT where set (a device machine's copy of the working tree
    carries git metadata that can be older than the files it ran), else the checkout's HEAD."""
    if os.environ.get("TURBINE_COMMIT"):
        return os.environ["TURBINE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
