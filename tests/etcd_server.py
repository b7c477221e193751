"""Run a private etcd server for tests (Debian's etcd-server package: /usr/bin/etcd)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from turbine.runtime.ports import free_port  # noqa: F401  (the tests import it from here)

ETCD_HINT = "install Debian's etcd-server (apt-get install -y etcd-server) or set TURBINE_TEST_ETCD=host:port"


class EtcdServer:
    """One single-member etcd on free local ports, its data under `work_dir`."""

    def __init__(self, work_dir: Path) -> None:
        self.binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(self.binary):
            raise RuntimeError(f"etcd binary not found: {ETCD_HINT}")
        self.data_dir = work_dir / "data"
        self.log_path = work_dir / "etcd.log"
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name", "turbine-test",
                    "--data-dir", str(self.data_dir),
                    "--listen-client-urls", client_url,
                    "--advertise-client-urls", client_url,
                    "--listen-peer-urls", peer_url,
                    "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", f"turbine-test={peer_url}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not self._healthy(client_url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd did not become healthy ({ETCD_HINT}); log tail:\n{tail}")
            time.sleep(0.1)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def wipe(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)

    @staticmethod
    def _healthy(client_url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{client_url}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False
