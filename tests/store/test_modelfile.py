"""Ollama's Modelfile dialect; every error names its line."""

from __future__ import annotations

import pytest

from pagoda.store.modelfile import ModelfileError, parse_modelfile

EXAMPLE = '''# a comment
FROM ./tiny.gguf

parameter temperature 0.2
PARAMETER num_ctx 128
PARAMETER stop "<|im_end|>"
PARAMETER stop <|im_start|>
TEMPLATE """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}<|im_start|>user
{{ .Prompt }}<|im_end|>
"""
SYSTEM You are terse.
LICENSE """MIT"""
LICENSE "Apache-2.0"
MESSAGE user Hello
MESSAGE assistant """Hi
there"""
'''


def test_parses_every_instruction(tmp_path):
    mf = parse_modelfile(EXAMPLE, base_dir=tmp_path)
    assert mf.from_ == "./tiny.gguf" and mf.from_line == 2
    assert mf.parameters == {"temperature": 0.2, "num_ctx": 128, "stop": ["<|im_end|>", "<|im_start|>"]}
    assert mf.template.startswith("{{ if .System }}<|im_start|>system\n") and mf.template.endswith("<|im_end|>\n")
    assert mf.system == "You are terse."
    assert mf.licenses == ["MIT", "Apache-2.0"]
    assert mf.messages == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi\nthere"}]
    assert mf.from_path() is None
    (tmp_path / "tiny.gguf").write_bytes(b"")
    assert mf.from_path() == tmp_path / "tiny.gguf"


@pytest.mark.parametrize("text, line, words", [
    ("FROM x\nBOGUS y\n", 2, "unknown instruction 'BOGUS'"),
    ("FROM x\n\n# c\nPARAMETER top_k many\n", 4, "top_k must be an integer"),
    ("FROM x\nPARAMETER temperature hot\n", 2, "must be a number"),
    ("FROM x\nPARAMETER nonsense 1\n", 2, "unknown parameter 'nonsense'"),
    ("FROM x\nPARAMETER num_ctx\n", 2, "needs a value"),
    ("FROM x\nTEMPLATE \"\"\"abc\nstill open\n", 2, "unterminated"),
    ("FROM x\nSYSTEM \"\"\"a\nb\"\"\" trailing\n", 3, "text after the closing"),
    ("FROM x\nSYSTEM \"open\n", 2, "unterminated \""),
    ("PARAMETER seed 1\n", 1, "no FROM"),
    ("FROM x\nFROM y\n", 2, "a second FROM (the first is on line 1)"),
    ("FROM x\nMESSAGE robot hi\n", 2, "MESSAGE role"),
    ("FROM x\nADAPTER\n", 2, "ADAPTER needs a LoRA adapter"),
    ("FROM x\nADAPTER a.gguf\nADAPTER b.gguf\n", 3, "a second ADAPTER (the first is on line 2)"),
    ("FROM\n", 1, "FROM needs a model"),
])
def test_errors_name_the_line(text, line, words):
    with pytest.raises(ModelfileError) as info:
        parse_modelfile(text)
    assert info.value.line == line
    assert f"Modelfile line {line}:" in str(info.value) and words in str(info.value)


def test_instructions_are_case_insensitive_and_bools_parse():
    mf = parse_modelfile("from base:7b\nPaRaMeTeR use_mmap false\nparameter seed 42")
    assert mf.from_ == "base:7b" and mf.parameters == {"use_mmap": False, "seed": 42}
