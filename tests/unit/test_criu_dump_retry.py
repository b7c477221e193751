"""The tests' CRIU helper tries a dump again only when CRIU refused it for a closed in-flight socket (a
moment's state of a listener's queue), and returns any other failure at once. A stand-in `criu` script
here: the real one runs in tests/integration/test_checkpoint_vllm.py."""

from __future__ import annotations

import stat

from tests.integration import criu


def fake_criu(tmp_path, first_error: str):
    """A `criu` that writes `first_error` to its log and fails on its first call, then succeeds."""
    script = tmp_path / "criu"
    calls = tmp_path / "calls"
    script.write_text(f"""#!/bin/bash
set -e
dir=""; log=""
while [ $# -gt 0 ]; do case "$1" in -D) dir=$2; shift 2;; -o) log=$2; shift 2;; *) shift;; esac; done
echo x >> {calls}
touch "$dir/core-1.img"
if [ "$(wc -l < {calls})" = 1 ]; then echo "(00.4) Error (criu/sk-unix.c:525): {first_error}" > "$dir/$log"; exit 1; fi
echo ok > "$dir/$log"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), calls


def test_a_dump_refused_for_a_closed_in_flight_socket_is_tried_again(tmp_path):
    script, calls = fake_criu(tmp_path, "unix: Found a closed in-flight socket to 0x22881")
    images = tmp_path / "images"
    out = criu.dump(script, 999_999_999, images)
    assert out.returncode == 0 and calls.read_text().count("x") == 2
    assert "closed in-flight socket" in (images / "dump-refused.log").read_text()
    assert (images / "dump.log").read_text().strip() == "ok"


def test_any_other_refusal_is_returned_at_once(tmp_path):
    script, calls = fake_criu(tmp_path, "unix: Can't dump half of stream unix connection")
    out = criu.dump(script, 999_999_999, tmp_path / "images")
    assert out.returncode == 1 and calls.read_text().count("x") == 1
