"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking it against the base model before anything is loaded or queued.

PEFT names each pair after the module it adapts (``base_model.model.model.layers.3.self_attn.
q_proj.lora_A.weight``: A is [r, in], B is [out, r]) and scales the product by ``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with rsLoRA; ``alpha_pattern`` overrides alpha per module. What pagoda
cannot apply exactly is refused with the reason: DoRA, trained biases, ``modules_to_save``
(whole modules replaced), and targets other than the attention and MLP projections and a
mixture's fused experts (lora/expert_pairs.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagoda.lora.adapter import AdapterError, LoRAPair, PeftAdapter
from pagoda.lora.expert_pairs import expert_pairs

# the projections a PEFT adapter may target (Phi-3's fused ones included)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z_]+))\.lora_([AB])\.weight$")


_PREFIX = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:layers\.\d+\.)?")  # for naming a module


def read_peft_adapter(path: str, hf_config: dict, max_rank: int) -> PeftAdapter:
    """The PEFT adapter at ``path``, checked against the base's ``hf_config`` (layers, shapes) and the
    rank limit; an ``AdapterError`` names the problem."""
    root = Path(path)
    config = _read_config(root)
    _check_config(config, root)
    tensors = _read_tensors(root)
    experts = expert_pairs(tensors, config, hf_config, root, lambda module, rank: _scale(config, module, rank))
    pairs = {**_pairs(tensors, config, root, allow_empty=bool(experts)), **experts}
    rank = max(pair.a.shape[0] for pair in pairs.values())
    if rank > max_rank:
        raise AdapterError(f"adapter {root} has rank {rank}, above the server's --max-lora-rank {max_rank}")
    check_shapes(pairs, hf_config, root)
    return PeftAdapter(str(root), rank, pairs)


def _read_config(root: Path) -> dict:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"{root} is not a PEFT adapter: it has no adapter_config.json")
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file} is not valid JSON: {exc}") from None


def _check_config(config: dict, root: Path) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {root} is a {config.get('peft_type')} adapter; pagoda serves LoRA only")
    if config.get("use_dora"):
        raise AdapterError(f"adapter {root} uses DoRA, which pagoda does not apply")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {root} trains biases (bias={config['bias']!r}); pagoda applies bias='none' only")
    if config.get("modules_to_save"):
        raise AdapterError(f"adapter {root} replaces whole modules (modules_to_save={config['modules_to_save']}); "
                           "pagoda applies low-rank pairs only")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {root} sets fan_in_fan_out (Conv1D layers), which no pagoda model has")


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    safetensors, binary = root / "adapter_model.safetensors", root / "adapter_model.bin"
    try:
        if safetensors.is_file():
            return load_file(str(safetensors))
        if binary.is_file():
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: the loader's own message
        raise AdapterError(f"cannot read the weights of adapter {root}: {exc}") from None
    raise AdapterError(f"adapter {root} has no adapter_model.safetensors (or adapter_model.bin)")


def _pairs(tensors: dict[str, torch.Tensor], config: dict, root: Path, allow_empty: bool = False) -> dict[str, LoRAPair]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unsupported = set()
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in PROJECTIONS:  # (a mixture's experts among them)
            unsupported.add(_PREFIX.sub("", key.split(".lora_")[0]))
            continue
        halves.setdefault(match.group(1), {})[match.group(4)] = tensor.float()
    if unsupported:
        raise AdapterError(f"adapter {root} targets modules pagoda does not adapt: {', '.join(sorted(unsupported))} "
                           f"(supported: the attention and MLP projections {', '.join(PROJECTIONS)})")
    if not halves and not allow_empty:
        raise AdapterError(f"adapter {root} holds no LoRA weights")
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            raise AdapterError(f"adapter {root}: {module} has lora_{''.join(half)} without its other half")
        a, b = half["A"], half["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {root}: {module}'s pair has shapes {tuple(a.shape)} and {tuple(b.shape)}")
        pairs[module] = LoRAPair(a, b, _scale(config, module, a.shape[0]))
    return pairs


def _scale(config: dict, module: str, rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):  # PEFT's rule: the key matches the module name's end
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_shapes(pairs: dict[str, LoRAPair], hf_config: dict, root: Path) -> None:
    """Each pair's in and out features against the base's projection (full, unsharded) shapes."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    kv = int(hf_config.get("num_key_value_heads") or heads) * head_dim
    inter = int(hf_config.get("intermediate_size") or 0)
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden), "qkv_proj": (hidden, heads * head_dim + 2 * kv),
              "gate_up_proj": (hidden, 2 * inter)}
    layers = int(hf_config["num_hidden_layers"])
    for module, pair in pairs.items():
        if ".experts." in module:
            continue  # (checked against the mixture's shapes as they were read: lora/expert_pairs.py)
        index, name = int(module.split(".")[1]), module.rsplit(".", 1)[1]
        if index >= layers:
            raise AdapterError(f"adapter {root} adapts {module}, but the base model has {layers} layers")
        want_in, want_out = shapes[name]
        if pair.a.shape[1] != want_in or pair.b.shape[0] != want_out:
            raise AdapterError(f"adapter {root} was trained for another base: {module} maps {pair.a.shape[1]} → "
                               f"{pair.b.shape[0]} features, this model's {want_in} → {want_out}")
