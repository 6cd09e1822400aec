"""`pagoda encrypt`: seal a model into an encrypted container, make a key, check a container.

    pagoda encrypt --generate-key model.key                          # a new random 256-bit key (0600)
    pagoda encrypt ./my-hf-model -o my-model.pgenc --key-file model.key
    PAGODA_MODEL_KEY=$(cat model.key) pagoda encrypt model.Q4_K_M.gguf -o model.pgenc
    pagoda encrypt --verify my-model.pgenc --key-file model.key        # authenticate every chunk
    pagoda serve --model my-model.pgenc --model-key-file model.key

The key comes from a file (--key-file) or an environment variable (--key-env, default
PAGODA_MODEL_KEY), never from the command line, where other users could read it (ps, shell history).
``add_parser`` imports nothing heavy; ``run`` imports pagoda.security.encryption and the container's loader modules (cryptography loads when a key is derived).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

KEY_ENV = "PAGODA_MODEL_KEY"  # = pagoda.loader.model_keys.KEY_ENV, without importing it here
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "encrypt", help="encrypt a model (AES-256-GCM) for serving with --model-key-file; --generate-key makes a key",
        description=__doc__.split("``add_parser``")[0].rstrip())
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face model directory, or a catalog / store name (with --verify: "
                        "an encrypted model)")
    p.add_argument("-o", "--output", default=None, help="the encrypted model to write")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--key-file", default=None, help="file holding the key: 64 hex characters (as --generate-key "
                     "writes), 32 raw bytes, or a passphrase (stretched with scrypt)")
    key.add_argument("--key-env", default=None, metavar="NAME",
                     help=f"name of the environment variable holding the key (default: {KEY_ENV})")
    p.add_argument("--generate-key", default=None, metavar="KEY_FILE",
                   help="write a new random 256-bit key to KEY_FILE (mode 0600); with MODEL, encrypt with it")
    p.add_argument("--verify", action="store_true",
                   help="authenticate every chunk of the encrypted MODEL with the key, and list what it holds")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="bytes per authenticated chunk (default: 1 MiB)")
    p.add_argument("--force", action="store_true", help="replace an existing output (or key file)")
    p.set_defaults(func=run)
    return p


def run(ns: argparse.Namespace) -> int:
    # deferred: keeps `pagoda` light at start
    from pagoda.loader.encrypted_container import DEFAULT_CHUNK_SIZE, EncryptedModelReader
    from pagoda.loader.model_keys import load_key  # deferred: keeps `pagoda` light at start
    from pagoda.security import encryption  # deferred: keeps `pagoda` light at start

    if ns.key_env is not None:  # the messages never repeat the value: it may be a key typed by mistake
        if not _ENV_NAME.fullmatch(ns.key_env) or _HEX_KEY.fullmatch(ns.key_env):
            raise ValueError("--key-env takes the NAME of an environment variable that holds the key, not the key")
        if not os.environ.get(ns.key_env):
            raise ValueError("--key-env: that environment variable is not set (--key-env takes the NAME of the "
                             "variable that holds the key, not the key)")
    key_env = ns.key_env or KEY_ENV
    key_file = ns.key_file
    if ns.generate_key is not None:
        if ns.verify:
            raise ValueError("--generate-key and --verify do not go together")
        if key_file is not None or ns.key_env is not None:
            raise ValueError("--generate-key writes the key to use: leave out --key-file / --key-env")
        path = encryption.generate_key_file(ns.generate_key, force=ns.force)
        print(f"wrote a new 256-bit key to {path} (mode 0600). Keep it secret and backed up: "
              "without it the encrypted model cannot be read.", file=sys.stderr)
        if ns.model is None:
            return 0
        key_file = path
    if ns.model is None:
        raise ValueError("give the MODEL to encrypt (or --generate-key KEY_FILE)")
    key = load_key(key_file, key_env)

    if ns.verify:
        if ns.output is not None:
            raise ValueError("--verify checks MODEL in place; it takes no --output")
        with EncryptedModelReader(ns.model, key) as reader:
            total = reader.verify()
            print(f"{ns.model}: OK, {reader.format} model, {len(reader.members)} files, {total} bytes, "
                  f"every chunk authenticated")
            for m in reader.members:
                print(f"  {m.size:>14}  {m.name}")
        return 0

    if ns.output is None:
        raise ValueError("give the encrypted model's path with -o/--output")
    chunk_size = ns.chunk_size or DEFAULT_CHUNK_SIZE
    out = encryption.encrypt_model(ns.model, ns.output, key, chunk_size=chunk_size, force=ns.force)
    how = f"--model-key-file {key_file}" if key_file is not None else f"(the key in ${KEY_ENV})"
    print(f"wrote {out}; serve it with: pagoda serve --model {out} {how}", file=sys.stderr)
    return 0
