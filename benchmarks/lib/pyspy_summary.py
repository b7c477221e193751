"""What py-spy's raw recordings (`record -f raw --threads`, one line per stack: frames joined by ';', then a sample
count) say per thread: how many samples each thread has, its most frequent leaf frames, and the share of its samples
under frames that match a pattern. With a `--gil` recording beside an `--idle` one of the same run, a thread's GIL
samples over its idle-included samples is the share of the run it held the GIL.

  python -m benchmarks.lib.pyspy_summary RUN/pyspy-TAG-all.txt [RUN/pyspy-TAG-gil.txt] [--under kvbm,connector]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_PROCESS = re.compile(r'process (\d+):"([^"]*)"')


def _thread_key(frames: list[str]) -> tuple[str, list[str]]:
    """'process name / thread name' of a stack, and its Python frames (outermost first)."""
    procs, thread, rest = [], "?", []
    for i, f in enumerate(frames):
        m = _PROCESS.match(f)
        if m:
            procs.append(m.group(2).split()[0][-40:] or m.group(1))
        elif f.startswith("thread ("):
            thread = f.split(": ", 1)[-1] if ": " in f else f
            thread = re.sub(r"_\d+$", "_N", thread)  # a pool's threads as one
            rest = frames[i + 1:]
            break
    return f"{procs[-1] if procs else '?'} / {thread}", rest


def load(path: Path) -> dict[str, collections.Counter]:
    """thread key -> Counter of stacks (tuples of frames)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        key, frames = _thread_key(stack.split(";"))
        out[key][tuple(frames)] += int(n)
    return out


def summarize(all_path: Path, gil_path: Path | None, under: list[str], top: int) -> str:
    threads = load(all_path)
    gil = load(gil_path) if gil_path else {}
    lines = []
    for key, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(stacks.values())
        held = sum(gil.get(key, {}).values())
        lines.append(f"== {key}: {total} samples" + (f", GIL held in {held} ({held / total:.1%})" if gil else ""))
        for pat in under:
            n = sum(c for s, c in stacks.items() if any(pat in f for f in s))
            g = sum(c for s, c in gil.get(key, {}).items() if any(pat in f for f in s))
            if n:
                lines.append(f"   under '{pat}': {n} ({n / total:.1%})" + (f", GIL {g} ({g / total:.1%})" if gil else ""))
        leaves = collections.Counter()
        for s, c in stacks.items():
            leaves[s[-1] if s else "(no frame)"] += c
        for leaf, c in leaves.most_common(top):
            lines.append(f"   {c / total:6.1%}  {leaf}")
        if gil.get(key):
            gleaves = collections.Counter()
            for s, c in gil[key].items():
                gleaves[s[-1] if s else "(no frame)"] += c
            lines.append("   holding the GIL:")
            for leaf, c in gleaves.most_common(top):
                lines.append(f"   {c / total:6.1%}  {leaf}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("all", type=Path, help="a recording with --idle --threads")
    p.add_argument("gil", type=Path, nargs="?", help="a --gil --threads recording of the same run")
    p.add_argument("--under", default="kvbm", help="comma-separated substrings of frames to count samples under")
    p.add_argument("--top", type=int, default=8, help="leaf frames per thread")
    a = p.parse_args(argv)
    print(summarize(a.all, a.gil, [u for u in a.under.split(",") if u], a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
