"""Where a resolved model's files live (``ModelFiles``, what loader/resolve.py answers), and, for an
encrypted model, where its container and key are (``EncryptedModel``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagoda.loader.model_keys import KEY_ENV, ModelKey, load_key
from pagoda.models.vision_config import language_view


@dataclass(frozen=True)
class EncryptedModel:
    """Where a resolved model's weights come from when it is a container (``ModelFiles.encryption``).
    Holds the key's location, never the key: it is pickled to engine and worker processes, which
    read the key themselves (the same key file, or the same environment variable)."""

    container: Path
    format: str  # "gguf" or "safetensors"
    key_file: Path | None
    key_env: str = KEY_ENV
    header_sha256: str = ""  # of the header seen at resolve time: a container replaced since is an error

    def key(self) -> ModelKey:
        return load_key(self.key_file, self.key_env)


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's metadata (config.json, tokenizer) and weights live."""

    name: str  # what the user asked for
    metadata_dir: Path  # config.json, tokenizer.json, tokenizer_config.json, generation_config.json
    gguf_file: Path | None = None  # weights come from here when set, else *.safetensors in metadata_dir
    # An encrypted container (pagoda/loader/encrypted_model.py): metadata_dir holds its decrypted
    # metadata (a private temporary directory), the weights are decrypted into memory at load.
    encryption: EncryptedModel | None = None
    # A store model's LoRA adapter (a Modelfile's ADAPTER): every request runs under it (lora/config.py)
    adapter: Path | None = None

    @property
    def format(self) -> str:
        if self.encryption is not None:
            return self.encryption.format
        return "gguf" if self.gguf_file else "safetensors"

    def hf_config(self) -> dict:
        path = self.metadata_dir / "config.json"
        try:
            return language_view(json.loads(path.read_text()))  # a vision-language model's text keys on top
        except FileNotFoundError:
            raise ValueError(f"{self.metadata_dir} has no config.json") from None
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
