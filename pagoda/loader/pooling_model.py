"""Which runner a model gets (vLLM's `--runner`: generate or pooling) and, for pooling, how it
pools: read from a sentence-transformers directory (modules.json, the Pooling module's
config.json, a Normalize module, sentence_bert_config.json's max_seq_length) where there is one,
else the family's default (an encoder: CLS, a decoder: LAST; normalized), with
`--pooler-config` over either. An encoder (BERT) can only pool; a sentence-transformers
directory pools unless `--runner generate` says otherwise; any other model generates unless
`--runner pooling` says otherwise."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagoda.engine_args import RUNNERS
from pagoda.pooling_params import PoolerConfig

# sentence-transformers' Pooling config key → pagoda's pooling type
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class RunnerChoice:
    runner: str  # "generate" or "pooling"
    pooler: PoolerConfig | None  # the pooling runner's
    max_seq_length: int | None = None  # sentence-transformers' cap on a prompt (tokens), if any
    why: str = ""


def choose_runner(requested: str | None, model_dir: Path, architecture: str, encoder: bool, hf_config: dict,
                  pooler_config: str | dict | None = None) -> RunnerChoice:
    """The runner for ``requested`` (auto, generate, pooling) and the model in ``model_dir``;
    ``encoder``: its architecture keeps no KV cache (it cannot generate)."""
    requested = (requested or "auto").lower()
    if requested not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {requested!r}")
    st = read_sentence_transformers(model_dir)
    if requested == "generate" and encoder:
        raise ValueError(f"{architecture} is an encoder: it cannot generate text; serve it with --runner pooling "
                         "(the default for it) for embeddings and scores")
    if requested == "generate" or (requested == "auto" and not encoder and st is None):
        if pooler_config is not None:
            raise ValueError("pooler_config applies to the pooling runner (--runner pooling)")
        return RunnerChoice("generate", None, why="a decoder generates unless --runner pooling")
    default = ("CLS", False, None) if architecture.endswith("ForSequenceClassification") else \
        ("CLS" if encoder else "LAST", True, None)  # a cross-encoder's head reads the first token, unnormalized
    pooling_type, normalize, max_len = st if st is not None else default
    pooler = PoolerConfig(pooling_type, normalize, matryoshka_dimensions(hf_config)).with_overrides(pooler_config)
    why = ("--runner pooling" if requested == "pooling" else
           "an encoder" if encoder else "a sentence-transformers model (modules.json)")
    return RunnerChoice("pooling", pooler, max_len, why)


def sep_token_id(model_dir: Path, hf_config: dict) -> int:
    """The tokenizer's separator id (config.json's sep_token_id, else tokenizer_config.json's
    sep_token looked up in tokenizer.json), which marks where a pair's second text begins."""
    if hf_config.get("sep_token_id") is not None:
        return int(hf_config["sep_token_id"])
    from tokenizers import Tokenizer  # deferred: only a cross-encoder needs it here

    config_file = Path(model_dir) / "tokenizer_config.json"
    sep = (_read(config_file) if config_file.is_file() else {}).get("sep_token", "[SEP]")
    sep = sep.get("content") if isinstance(sep, dict) else sep
    found = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).token_to_id(sep)
    if found is None:
        raise ValueError(f"{model_dir}: the tokenizer has no separator token {sep!r}, which a cross-encoder needs")
    return found


def matryoshka_dimensions(hf_config: dict) -> tuple[int, ...] | None:
    """The widths a request may cut the model's vectors to (vLLM reads the same config.json keys):
    ``matryoshka_dimensions`` lists them; ``is_matryoshka: true`` allows any; neither, none (())."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return None if hf_config.get("is_matryoshka") else ()


def read_sentence_transformers(model_dir: Path) -> tuple[str, bool, int | None] | None:
    """(pooling type, normalize, max_seq_length) of a sentence-transformers directory, or None
    for any other. Modules pagoda does not run (Dense, other poolings) are refused by name."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ValueError(f"{modules_file}: sentence-transformers modules {unknown} are not supported "
                         "(Transformer, Pooling, Normalize)")
    pooling_type = "CLS"
    for module, kind in zip(modules, kinds):
        if kind == "Pooling":
            pooling_type = _pooling_mode(Path(model_dir) / module.get("path", "") / "config.json")
    bert_config = Path(model_dir) / "sentence_bert_config.json"
    max_len = _read(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return pooling_type, "Normalize" in kinds, int(max_len) if max_len else None


def _pooling_mode(path: Path) -> str:
    config = _read(path) if path.is_file() else {}
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    bad = [key for key in on if key in _ST_UNSUPPORTED or key not in _ST_MODES]
    if bad or len(on) != 1:
        raise ValueError(f"{path}: pooling {on or 'none'} is not supported: one of "
                         f"{', '.join(_ST_MODES)} must be on")
    return _ST_MODES[on[0]]


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
