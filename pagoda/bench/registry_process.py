"""A real OCI registry as a child process: the CNCF distribution registry (Debian's
``docker-registry``) on 127.0.0.1, storing into a directory of the caller's, with optional basic
auth from an htpasswd file (bcrypt entries, as the registry requires).

The store's tests (``tests/store/conftest.py``) and the push/pull benchmark
(``benchmarks/store_transfer.py``) both start their registry through ``start_registry``::

    with start_registry(tmp_dir) as registry:   # stopped when the block ends
        push(layout, parse_ref(f"{registry.host}/library/smollm2:bench"), insecure=True)
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from pagoda.bench.servers import free_port

BINARY_NAMES = ("docker-registry", "registry")  # Debian's package name, then upstream's


class RegistryNotInstalled(RuntimeError):
    """No registry binary on PATH."""


def registry_binary() -> str | None:
    """The registry's executable on PATH, or None."""
    for name in BINARY_NAMES:
        if found := shutil.which(name):
            return found
    return None


@dataclass
class RegistryProcess:
    """A running registry: ``host`` is ``127.0.0.1:PORT``, ``root`` its storage directory."""

    host: str
    root: Path
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def blob_data_path(self, digest: str) -> Path:
        """Where the registry keeps blob ``sha256:<hex>`` on disk (its filesystem driver's layout)."""
        hexdigest = digest.split(":", 1)[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _config(data: Path, port: int, htpasswd: Path | None) -> str:
    auth = f"auth:\n  htpasswd:\n    realm: pagoda-test\n    path: {htpasswd}\n" if htpasswd else ""
    return ("version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{port}\n" + auth)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline: float = 30.0) -> None:
    """Poll ``url`` (the registry's ``/v2/``) until it answers 200, or 401 under auth; RuntimeError,
    with the end of the registry's log, if the process exits or ``deadline`` seconds pass."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code in (200, 401):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer {url} within {deadline} s: {log.read_text()[-2000:]}")


def start_registry(workdir: Path, htpasswd: Path | None = None, *, deadline: float = 30.0) -> RegistryProcess:
    """Start a registry on a free port of 127.0.0.1, storing under ``workdir/data`` (its config and
    log go beside it), with basic auth when ``htpasswd`` is given; returns once it answers.
    RegistryNotInstalled when there is no binary (``apt-get install docker-registry``)."""
    binary = registry_binary()
    if binary is None:
        raise RegistryNotInstalled("docker-registry is not installed (apt-get install docker-registry; "
                                   ".ci/run installs it)")
    workdir = Path(workdir)
    port = free_port()
    data = workdir / "data"
    data.mkdir(parents=True)
    config = workdir / "config.yml"
    config.write_text(_config(data, port, htpasswd))
    log = workdir / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/", proc, log, deadline)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return RegistryProcess(f"127.0.0.1:{port}", data, proc, log)
