"""Ollama's Go templates converted to Jinja (the common forms), or refused by name."""

from __future__ import annotations

import time

import pytest

from pagoda.store.gotemplate import to_jinja
from pagoda.tokenizer import _compile_template

CHATML = '''{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
'''
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi {% raw %}"}]


def _render(template: str, messages=MESSAGES) -> str:
    # pagoda's own template environment (trim_blocks and lstrip_blocks, as Hugging Face's)
    return _compile_template(to_jinja(template)).render(messages=messages, add_generation_prompt=True)


def test_range_over_messages():
    assert _render(CHATML) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi {% raw %}<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_newlines_around_blocks_are_kept():
    template = "{{ if .System }}\n  S\n{{ end }}\n  {{ range .Messages }}\n{{ .Role }}\n{{ end }}\n"
    assert _render(template) == "\n  S\n\n  \nsystem\n\nuser\n\n"


def test_single_turn_form_with_system_and_prompt():
    template = "{{ if .System }}[S]{{ .System }}{{ end }}[U]{{ .Prompt }}[A]{{ .Response }}"
    assert _render(template) == "[S]Be brief.[U]Hi {% raw %}[A]"
    assert _render(template, MESSAGES[1:]) == "[U]Hi {% raw %}[A]"


def test_conditions_variables_and_trim_markers():
    template = ('{{- range $i, $m := .Messages }}{{ if eq $m.Role "user" }}U{{ $i }}:{{ $m.Content }}'
                '{{ else if or (eq .Role "assistant") (eq .Role "tool") }}A:{{ .Content }}{{ else }}-{{ end }}'
                '{{ end }}{{/* comment */}}  {{- if not (eq (len $.Messages) 0) }} n={{ len .Messages }}{{ end -}}  !')
    assert _render(template) == "-U1:Hi {% raw %} n=2!"


@pytest.mark.parametrize("template, words", [
    ("{{ .Tools }}", ".Tools"),
    ("{{ range .Messages }}x", "without {{ end }}"),
    ("{{ slice .Messages 1 }}", "slice"),
    ("{{ with .System }}x{{ end }}", "with"),
    ("{{ .System | html }}", "pipelines"),
    # what a request's template may nest (each range inside another multiplies the rendering)
    ("{{ range $.Messages }}" * 3 + "x" + "{{ end }}" * 3, "ranges nested more than 2 deep"),
    ("{{ if .System }}" * 17 + "x" + "{{ end }}" * 17, "blocks nested more than 16 deep"),
    ("{{ if " + "(" * 17 + ".System" + ")" * 17 + " }}x{{ end }}", "parentheses nested more than 16 deep"),
    ("x {{ .Prompt", "never closed"),
])
def test_what_it_cannot_convert_is_named(template, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")):
        to_jinja(template)


def test_two_nested_ranges_and_long_templates_convert_quickly():
    nested = "{{ range $.Messages }}{{ range $.Messages }}{{ .Role }}{{ end }}{{ end }}"
    assert _render(nested) == "systemuser" * 2
    start = time.monotonic()
    with pytest.raises(ValueError):
        to_jinja("{{" * 16_000 + "}")  # a lazy regex read to the end from each '{{': 35 s
    to_jinja("{{ if .System }}x{{ end }}" * 2_000)
    assert time.monotonic() - start < 2
