"""Run a private NATS server for tests that stop and restart it (Debian's nats-server package).
Never the machine's shared server: a free port of its own, kept across restarts."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from turbine.runtime.ports import free_port  # noqa: F401  (the tests import it from here)

NATS_HINT = "install Debian's nats-server (apt-get install -y nats-server)"


class NatsServer:
    def __init__(self, log_path: Path, jetstream_dir: Path | None = None, max_payload: int | None = None) -> None:
        """`jetstream_dir`: JetStream on, its file storage there (kept across restarts). `max_payload`: the
        largest message it takes (nats-server's default: 1 MiB)."""
        self.binary = shutil.which("nats-server")
        if self.binary is None:
            raise RuntimeError(f"nats-server binary not found: {NATS_HINT}")
        self.log_path = log_path
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.jetstream_dir = jetstream_dir
        self.config: Path | None = None
        if max_payload is not None:
            self.config = log_path.with_suffix(".conf")
            self.config.write_text(f"max_payload: {max_payload}\n")

    def start(self, timeout: float = 10.0) -> None:
        with open(self.log_path, "ab") as log:
            js = ["-js", "-sd", str(self.jetstream_dir)] if self.jetstream_dir is not None else []
            config = ["-c", str(self.config)] if self.config is not None else []
            self.proc = subprocess.Popen([self.binary, "-a", "127.0.0.1", "-p", str(self.port), *js, *config],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server did not start on port {self.port}; log tail:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: an outage, not a goodbye (clients get no notice)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                return s.recv(4) == b"INFO"
        except OSError:
            return False
