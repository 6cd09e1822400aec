"""Refresh the web pages' vendored front-end libraries from the npm registry.

    python tools/vendor_web.py          # needs `npm` (only to download the packages)

The versions are pinned below; the files land in pagoda/entrypoints/web/static/vendor/<name>/
with the package's licence beside them, and are committed, so the pages work offline and a
wheel carries them (pyproject.toml's package-data). Why these three: docs/architecture.md,
"The web playground and the engine dashboard".
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "pagoda" / "entrypoints" / "web" / "static" / "vendor"

# name: (npm package@version, files to keep from the package, relative to package/)
PACKAGES = {
    "marked": ("marked@18.2.1", ["lib/marked.umd.js", "LICENSE"]),
    "dompurify": ("dompurify@3.5.0", ["dist/purify.min.js", "LICENSE"]),
    "uplot": ("uplot@1.6.32", ["dist/uPlot.iife.min.js", "dist/uPlot.min.css", "LICENSE"]),
    # /docs (FastAPI's Swagger UI), which would otherwise load it from a CDN and stay blank offline
    "swagger-ui": ("swagger-ui-dist@5.35.0", ["swagger-ui-bundle.js", "swagger-ui.css", "LICENSE"]),
}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, files) in PACKAGES.items():
            tgz = subprocess.run(["npm", "pack", spec, "--silent"], cwd=tmp, check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1]
            with tarfile.open(Path(tmp) / tgz) as archive:
                archive.extractall(Path(tmp) / name, filter="data")
            out = VENDOR / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for f in files:
                shutil.copy(Path(tmp) / name / "package" / f, out / Path(f).name)
            (out / "VERSION").write_text(spec + "\n")
            print(f"{spec} -> {out.relative_to(VENDOR.parent.parent.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
