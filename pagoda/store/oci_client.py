"""An OCI distribution client (the protocol Ollama's registry and the CNCF registry speak), over httpx.

Push: for each blob (config first, then layers) a HEAD says whether the registry has it; if not,
a cross-repository mount is tried when another local model on the same registry holds the blob
(``POST .../blobs/uploads/?mount=<digest>&from=<repo>``); otherwise a chunked upload (POST for a
session, PATCH per chunk with ``Content-Range``, PUT ``?digest=`` to close). Then the manifest is
PUT with its exact bytes and the digest the registry answers is checked.

Pull: GET the manifest (Docker v2 or OCI), check ``Docker-Content-Digest``; each missing blob is
downloaded into ``blobs/sha256-<hex>-partial`` under an exclusive ``flock`` (a second pull of the
same blob waits, then finds it done), resumed with ``Range: bytes=<have>-`` after an interruption
(this pull's own retries, or a later ``pagoda pull``), hashed as it arrives and renamed onto its
final name only when the digest matches (``DigestMismatch`` otherwise: the partial is removed).
The manifest is written last, so a failed pull leaves no model behind.

Auth (``oci_http.py``): a 401 with ``WWW-Authenticate: Basic`` is answered with the
credentials; ``Bearer realm=..,service=..,scope=..`` with a token fetched from the realm.
Credentials come from ``PAGODA_REGISTRY_USERNAME`` / ``PAGODA_REGISTRY_PASSWORD`` (for the registry
``PAGODA_REGISTRY_HOST`` names, when set) and go only to the registry's own origin (and to a token
realm there or on https); a redirect elsewhere is followed without them. A manifest is read up to
4 MiB. ``insecure`` (``--insecure``, or an ``http://`` reference) talks plain HTTP.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagoda.store import blobs, manifests
from pagoda.store.layout import Ref, StoreLayout, digest_hex
from pagoda.store.manifests import Layer, Manifest
from pagoda.store.oci_http import (
    RegistryError,
    RegistryHTTP,
    check,
    credentials_from_env,
    read_capped,
)

__all__ = ["RegistryClient", "RegistryError", "TransferStats", "describe", "pull", "push"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 32 << 20
ACCEPT = ", ".join(manifests.MANIFEST_TYPES)


@dataclass
class TransferStats:
    """What a push or pull did, per blob: ``uploaded`` / ``downloaded``, ``existed``, ``mounted``."""

    actions: dict[str, str] = field(default_factory=dict)  # digest -> action
    bytes: int = 0  # bytes sent or received
    seconds: float = 0.0
    manifest_digest: str = ""
    resumed_from: dict[str, int] = field(default_factory=dict)  # digest -> byte offset a download resumed at

    @property
    def throughput(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class _Progress:
    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm  # deferred: tqdm loads on first use

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                            leave=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RegistryClient:
    def __init__(self, host: str, *, insecure: bool = False, credentials: tuple[str, str] | None = None,
                 chunk_size: int = DEFAULT_CHUNK, progress: bool = False, retries: int = 3,
                 timeout: float = 60.0, transport: httpx.BaseTransport | None = None) -> None:
        self.host = host
        credentials = credentials if credentials is not None else credentials_from_env(host)
        self.chunk_size = chunk_size
        self.progress = progress
        self.retries = retries
        self._http = RegistryHTTP(host, f"{'http' if insecure else 'https'}://{host}", credentials, timeout, transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, url: str | httpx.URL, **kwargs) -> httpx.Response:
        return self._http.request(method, url, **kwargs)

    def _url(self, path_or_url: str) -> httpx.URL:
        return self._http.base.join(path_or_url)

    # -- blobs ------------------------------------------------------------------------------
    def blob_exists(self, repository: str, digest: str) -> bool:
        response = self._request("HEAD", f"/v2/{repository}/blobs/{digest}", follow=True)
        if response.status_code == 404:
            return False
        check(response, f"HEAD blob {digest}", 200)
        return True

    def mount_blob(self, repository: str, digest: str, source: str) -> str | None:
        """Try a cross-repository mount; None when mounted, else the upload URL the registry
        opened instead."""
        response = self._request("POST", f"/v2/{repository}/blobs/uploads/", params={"mount": digest, "from": source})
        if response.status_code == 201:
            return None
        check(response, f"mount {digest} from {source}", 202)
        return _location(response)

    def start_upload(self, repository: str) -> str:
        response = self._request("POST", f"/v2/{repository}/blobs/uploads/")
        check(response, f"start an upload to {repository}", 202)
        return _location(response)

    def upload_blob(self, path: Path, digest: str, size: int, location: str, progress: _Progress) -> None:
        offset = 0
        with open(path, "rb") as f:
            while chunk := f.read(self.chunk_size):
                response = self._request("PATCH", location, content=chunk, headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
                })
                check(response, f"upload {digest} (bytes {offset}-)", 202, 204)
                location = _location(response) if "location" in response.headers else location
                offset += len(chunk)
                progress.update(len(chunk))
        if offset != size:
            raise RegistryError(f"blob {digest} is {offset} bytes on disk, the manifest says {size}")
        url = self._url(location).copy_merge_params({"digest": digest})
        response = self._request("PUT", url, content=b"", headers={"Content-Type": "application/octet-stream"})
        check(response, f"finish the upload of {digest}", 201, 204)

    def download_blob(self, layout: StoreLayout, repository: str, layer: Layer, progress: _Progress,
                      stats: TransferStats) -> None:
        """Download one blob into the store, resuming a partial file; see the module docstring."""
        layout.check_writable()
        layout.blobs_dir.mkdir(parents=True, exist_ok=True)
        partial = layout.blobs_dir / f"sha256-{digest_hex(layer.digest)}-partial"
        with open(partial, "ab+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                if blobs.has_blob(layout, layer.digest, layer.size):  # another pull finished it meanwhile
                    with contextlib.suppress(FileNotFoundError):
                        if os.path.samefile(partial, f.name) and os.fstat(f.fileno()).st_size == 0:
                            partial.unlink()
                    progress.update(layer.size)
                    return
                self._download_locked(f, partial, layout, repository, layer, progress, stats)
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _download_locked(self, f, partial: Path, layout: StoreLayout, repository: str, layer: Layer,
                         progress: _Progress, stats: TransferStats) -> None:
        digest, size = layer.digest, layer.size
        h = hashlib.sha256()
        f.seek(0)
        have = 0
        while block := f.read(blobs.CHUNK):  # re-hash what an earlier attempt left
            if have + len(block) > size:
                break
            h.update(block)
            have += len(block)
        if have > size or os.fstat(f.fileno()).st_size > size:
            f.truncate(0)
            h, have = hashlib.sha256(), 0
        f.seek(have)
        progress.update(have)
        attempt = 0
        while have < size:
            headers = {"Range": f"bytes={have}-"} if have else {}
            if have:
                stats.resumed_from[digest] = have
                logger.info("resuming %s at byte %d", digest, have)
            try:
                response = self._request("GET", f"/v2/{repository}/blobs/{digest}", stream=True, follow=True,
                                         headers=headers)
                try:
                    if have and response.status_code == 200:  # no ranges: start over
                        f.seek(0)
                        f.truncate(0)
                        h, have = hashlib.sha256(), 0
                    elif have:
                        check(response, f"GET blob {digest} from byte {have}", 206)
                        start = re.match(r"bytes (\d+)-", response.headers.get("content-range", ""))
                        if not start or int(start.group(1)) != have:
                            raise RegistryError(f"GET blob {digest}: asked for bytes {have}-, got "
                                                f"{response.headers.get('content-range')!r}")
                    else:
                        check(response, f"GET blob {digest}", 200)
                    for chunk in response.iter_bytes():  # as they arrive: an interruption keeps what came
                        if have + len(chunk) > size:
                            raise blobs.DigestMismatch(f"blob {digest}: the registry sent more than its "
                                                       f"{size} bytes: rejected")
                        f.write(chunk)
                        h.update(chunk)
                        have += len(chunk)
                        stats.bytes += len(chunk)
                        progress.update(len(chunk))
                finally:
                    response.close()
            except (httpx.TransportError, RegistryError) as e:
                f.flush()
                if isinstance(e, RegistryError) and not isinstance(e.__cause__, httpx.TransportError):
                    raise
                attempt += 1
                if attempt > self.retries:
                    raise RegistryError(f"download of {digest} interrupted at byte {have} of {size} ({e}); "
                                        "pull again to resume") from e
                time.sleep(min(0.2 * 2 ** attempt, 2.0))
                continue
            if have < size:  # the body ended early without an error
                attempt += 1
                if attempt > self.retries:
                    raise RegistryError(f"download of {digest} ended at byte {have} of {size}; pull again to resume")
        f.flush()
        os.fsync(f.fileno())
        blobs.commit_file(layout, partial, digest, "sha256:" + h.hexdigest())

    # -- manifests --------------------------------------------------------------------------
    def get_manifest(self, ref: Ref) -> Manifest:
        response = self._request("GET", f"/v2/{ref.repository}/manifests/{ref.tag}", headers={"Accept": ACCEPT},
                                 follow=True, stream=True)
        try:
            if response.status_code == 404:
                raise RegistryError(f"{ref}: not found on {self.host} (HTTP 404)")
            check(response, f"GET manifest {ref}", 200)
            body = read_capped(response, manifests.MAX_MANIFEST_BYTES, f"GET manifest {ref}")
        except httpx.TransportError as e:
            raise RegistryError(f"GET manifest {ref}: {type(e).__name__}: {e}") from e
        finally:
            response.close()
        stated = response.headers.get("docker-content-digest")
        if stated and digest_hex(stated) != hashlib.sha256(body).hexdigest():
            raise blobs.DigestMismatch(f"manifest of {ref}: the registry says {stated}, its bytes hash to "
                                       f"sha256:{hashlib.sha256(body).hexdigest()}: rejected")
        try:
            return manifests.parse_manifest(body)
        except ValueError as e:
            raise RegistryError(f"manifest of {ref}: {e}") from None

    def put_manifest(self, ref: Ref, manifest: Manifest) -> str:
        body = manifest.to_bytes()
        response = self._request("PUT", f"/v2/{ref.repository}/manifests/{ref.tag}", content=body,
                                 headers={"Content-Type": manifest.media_type})
        check(response, f"PUT manifest {ref}", 201, 200)
        stated = response.headers.get("docker-content-digest")
        if stated and digest_hex(stated) != digest_hex(manifest.digest):
            raise RegistryError(f"the registry stored the manifest of {ref} as {stated}, expected {manifest.digest}")
        return manifest.digest

    # -- whole models -----------------------------------------------------------------------
    def push(self, layout: StoreLayout, ref: Ref, manifest: Manifest, mount_sources: dict[str, list[str]]) -> TransferStats:
        stats = TransferStats()
        start = time.perf_counter()
        todo = []
        for layer in manifest.blobs():
            if self.blob_exists(ref.repository, layer.digest):
                stats.actions[layer.digest] = "existed"
            else:
                todo.append(layer)
        progress = _Progress(self.progress, sum(layer.size for layer in todo), f"pushing {ref.short()}")
        try:
            for layer in todo:
                location = None
                for source in mount_sources.get(layer.digest, []):
                    if source == ref.repository:
                        continue
                    location = self.mount_blob(ref.repository, layer.digest, source)
                    if location is None:
                        stats.actions[layer.digest] = "mounted"
                        progress.update(layer.size)
                        break
                if stats.actions.get(layer.digest) == "mounted":
                    continue
                location = location or self.start_upload(ref.repository)
                self.upload_blob(layout.blob_path(layer.digest), layer.digest, layer.size, location, progress)
                stats.actions[layer.digest] = "uploaded"
                stats.bytes += layer.size
        finally:
            progress.close()
        stats.manifest_digest = self.put_manifest(ref, manifest)
        stats.seconds = time.perf_counter() - start
        return stats

    def pull(self, layout: StoreLayout, ref: Ref) -> TransferStats:
        stats = TransferStats()
        start = time.perf_counter()
        manifest = self.get_manifest(ref)
        todo = []
        for layer in manifest.blobs():
            if blobs.has_blob(layout, layer.digest, layer.size):
                stats.actions[layer.digest] = "existed"
            else:
                todo.append(layer)
        progress = _Progress(self.progress, sum(layer.size for layer in todo), f"pulling {ref.short()}")
        try:
            for layer in todo:
                self.download_blob(layout, ref.repository, layer, progress, stats)
                stats.actions[layer.digest] = "downloaded"
        finally:
            progress.close()
        manifests.write_manifest(layout, ref, manifest)
        stats.manifest_digest = manifest.digest
        stats.seconds = time.perf_counter() - start
        return stats


def _location(response: httpx.Response) -> str:
    """A response's ``Location`` as an absolute URL: a relative one is relative to the URL that
    answered (an upload may continue on another host than the registry's)."""
    return str(response.url.join(response.headers["location"]))


def mount_sources(layout: StoreLayout, ref: Ref, manifest: Manifest) -> dict[str, list[str]]:
    """For each blob of ``manifest``: the other repositories on ``ref``'s registry that a local
    manifest says hold it (candidates for a cross-repository mount)."""
    wanted = {layer.digest for layer in manifest.blobs()}
    sources: dict[str, list[str]] = {}
    for other in layout.refs():
        if other.host != ref.host or other.repository == ref.repository:
            continue
        with contextlib.suppress(ValueError):
            other_manifest = manifests.read_manifest(layout, other)
            for layer in other_manifest.blobs() if other_manifest else []:
                if layer.digest in wanted and other.repository not in sources.setdefault(layer.digest, []):
                    sources[layer.digest].append(other.repository)
    return sources


def push(layout: StoreLayout, ref: Ref, *, insecure: bool = False, progress: bool = False,
         **client_kwargs) -> TransferStats:
    manifest = manifests.read_manifest(layout, ref)
    if manifest is None:
        raise ValueError(f"model {ref.short()!r} not found in the store (`pagoda list`)")
    with RegistryClient(ref.host, insecure=insecure or ref.scheme == "http", progress=progress,
                        **client_kwargs) as client:
        return client.push(layout, ref, manifest, mount_sources(layout, ref, manifest))


def pull(layout: StoreLayout, ref: Ref, *, insecure: bool = False, progress: bool = False,
         **client_kwargs) -> TransferStats:
    with RegistryClient(ref.host, insecure=insecure or ref.scheme == "http", progress=progress,
                        **client_kwargs) as client:
        return client.pull(layout, ref)


def describe(stats: TransferStats) -> str:
    counts: dict[str, int] = {}
    for action in stats.actions.values():
        counts[action] = counts.get(action, 0) + 1
    parts = [f"{n} {action}" for action, n in sorted(counts.items())]
    rate = f", {stats.throughput / 2**20:.1f} MiB/s" if stats.bytes else ""
    return f"{', '.join(parts)}; {stats.bytes / 2**20:.1f} MiB in {stats.seconds:.2f} s{rate}"

