"""Which runner a model gets and how it pools (loader/pooling_model.py), from the files alone."""

from __future__ import annotations

import json

import pytest

from pagoda.loader.pooling_model import choose_runner, read_sentence_transformers
from tiny_models import make_tiny_bert


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("st") / "st", sentence_transformers="cls")


def test_a_sentence_transformers_directory_pools_as_its_modules_say(st_dir):
    assert read_sentence_transformers(st_dir) == ("CLS", True, 48)
    choice = choose_runner("auto", st_dir, "BertModel", True, {})
    assert (choice.runner, choice.pooler.pooling_type, choice.max_seq_length) == ("pooling", "CLS", 48)
    over = choose_runner("auto", st_dir, "BertModel", True, {}, '{"pooling_type": "mean", "normalize": false}')
    assert (over.pooler.pooling_type, over.pooler.normalize) == ("MEAN", False)


def test_a_decoder_generates_unless_told_to_pool(tmp_path):
    assert choose_runner("auto", tmp_path, "LlamaForCausalLM", False, {}).runner == "generate"
    pooled = choose_runner("pooling", tmp_path, "LlamaForCausalLM", False, {"matryoshka_dimensions": [32, 64]})
    assert (pooled.pooler.pooling_type, pooled.pooler.normalize, pooled.pooler.matryoshka_dimensions) == \
        ("LAST", True, (32, 64))
    with pytest.raises(ValueError, match="pooler_config applies to the pooling runner"):
        choose_runner("generate", tmp_path, "LlamaForCausalLM", False, {}, '{"pooling_type": "MEAN"}')


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense"}])),
     "modules \\['Dense'\\] are not supported"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True})),
     "pooling \\['pooling_mode_max_tokens'\\] is not supported"),
])
def test_what_pagoda_cannot_run_is_refused_by_name(tmp_path, change, message):
    d = make_tiny_bert(tmp_path / "st", sentence_transformers="mean")
    change(d)
    with pytest.raises(ValueError, match=message):
        read_sentence_transformers(d)


def test_bad_runner_and_pooling_type_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="runner must be one of"):
        choose_runner("embed", tmp_path, "LlamaForCausalLM", False, {})
    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of"):
        choose_runner("pooling", tmp_path, "LlamaForCausalLM", False, {}, '{"pooling_type": "MAX"}')
