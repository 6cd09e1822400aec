"""mkdocs hooks (mkdocs.yml `hooks:`): the site's benchmarks pages include benchmarks/README.md and
benchmarks/dialogue_turns.md (pymdownx.snippets), whose plots sit beside them under benchmarks/, outside
docs/. Each such image is added to the site at the same path, benchmarks/..., so the pages'
relative image links (`results/x.png` from docs/benchmarks/index.md) resolve, and a missing one
still fails `mkdocs build --strict`."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ("*.png", "*.svg", "*.jpg")


def on_files(files: Files, config) -> Files:
    for pattern in IMAGES:
        for path in sorted((ROOT / "benchmarks").rglob(pattern)):
            src_uri = path.relative_to(ROOT).as_posix()
            if files.get_file_from_path(src_uri) is None:
                files.append(File(src_uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
