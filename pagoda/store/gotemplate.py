"""Ollama's TEMPLATE (a Go ``text/template``) → a Jinja chat template, for the common forms.

Handled: text; ``{{ .System }}``, ``{{ .Prompt }}``, ``{{ .Response }}`` (the single-turn form:
the last system and user messages), ``{{ range .Messages }} ... {{ .Role }} {{ .Content }}
{{ end }}`` (also ``range $i, $m := .Messages``), ``if`` / ``else if`` / ``else`` / ``end``,
``eq`` / ``ne`` / ``and`` / ``or`` / ``not`` / ``len``, ``$.Field``, parentheses, trim markers
(``{{-`` / ``-}}``), comments. Anything else (tools, ``slice``, ``index``, ``with``, pipelines,
``template`` / ``define``) raises ValueError naming it, and the caller falls back to the GGUF's
own template.

A template is also code a request may send (Ollama's ``template`` field), so what it may nest is
bounded: each ``range`` inside another multiplies the rendering by the number of messages (20
nested ranges over two messages rendered 2^20 copies of the prompt), and deep nesting of blocks or
parentheses reaches recursive code (the parser here, Jinja's compiler).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|`[^`]*`|\(|\)|:=|,|\$\.[A-Za-z_][\w.]*|\$[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*|\$|'
                    r'\.[A-Za-z_][\w.]*|\.|-?\d+(?:\.\d+)?|[A-Za-z_]\w*)')
_ROOT_FIELDS = {"System": "System", "Prompt": "Prompt", "Response": "Response", "Messages": "messages"}
_MESSAGE_FIELDS = {"Role": "role", "Content": "content"}
MAX_RANGE_NESTING = 2  # a range inside a range (Ollama's own templates nest none over .Messages)
MAX_BLOCK_NESTING = 16  # if / range blocks inside each other
MAX_PARENS = 16  # parentheses inside each other in one action
# As Ollama's Template.Execute: .System joins the system messages (which stay in .Messages too).
_PRELUDE = (
    "{%- set System = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') "
    "| join('\\n\\n') +%}"
    "{%- set _users = messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list +%}"
    "{%- set Prompt = _users[-1] if _users else '' +%}"
    "{%- set Response = '' +%}"
)


class _Scope:
    def __init__(self, dot: str, variables: dict[str, str]) -> None:
        self.dot = dot  # "root" or the Jinja name of the current message
        self.variables = variables


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise ValueError(f"cannot read {text[pos:]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


class _Expr:
    def __init__(self, tokens: list[str], scope: _Scope) -> None:
        self.tokens, self.pos, self.scope = tokens, 0, scope
        self.depth = 0  # parentheses open

    def parse(self) -> str:
        out = self.call()
        if self.pos != len(self.tokens):
            raise ValueError(f"unexpected {' '.join(self.tokens[self.pos:])!r}")
        return out

    def call(self) -> str:
        head = self.tokens[self.pos] if self.pos < len(self.tokens) else None
        if head in ("eq", "ne", "and", "or", "not", "len"):
            self.pos += 1
            args = []
            while self.pos < len(self.tokens) and self.tokens[self.pos] != ")":
                args.append(self.operand())
            if head == "not" and len(args) == 1:
                return f"(not {args[0]})"
            if head == "len" and len(args) == 1:
                return f"({args[0]} | length)"
            if head in ("eq", "ne") and len(args) >= 2:
                if head == "ne":
                    return f"({args[0]} != {args[1]})"
                return "(" + " or ".join(f"{args[0]} == {a}" for a in args[1:]) + ")"
            if head in ("and", "or") and len(args) >= 2:
                return "(" + f" {head} ".join(args) + ")"
            raise ValueError(f"{head} with {len(args)} arguments")
        return self.operand()

    def operand(self) -> str:
        if self.pos >= len(self.tokens):
            raise ValueError("an expression ends early")
        tok = self.tokens[self.pos]
        self.pos += 1
        if tok == "(":
            self.depth += 1
            if self.depth > MAX_PARENS:
                raise ValueError(f"parentheses nested more than {MAX_PARENS} deep")
            inner = self.call()
            self.depth -= 1
            if self.pos >= len(self.tokens) or self.tokens[self.pos] != ")":
                raise ValueError("unbalanced parentheses")
            self.pos += 1
            return inner
        if tok.startswith('"'):
            return json.dumps(json.loads(tok))
        if tok.startswith("`"):
            return json.dumps(tok[1:-1])
        if re.fullmatch(r"-?\d+(?:\.\d+)?", tok):
            return tok
        if tok.startswith("$."):
            return _field(tok[2:], _Scope("root", {}))
        if tok.startswith("$"):
            name, dot, path = tok.partition(".")
            if name not in self.scope.variables:
                raise ValueError(f"unknown variable {name}")
            value = self.scope.variables[name]
            return _field(path, _Scope(value, {})) if dot else value
        if tok.startswith("."):
            return _field(tok[1:], self.scope)
        raise ValueError(f"unsupported function or word {tok!r}")


def _field(path: str, scope: _Scope) -> str:
    if path == "":
        if scope.dot == "root":
            raise ValueError("'.' at the top level")
        return scope.dot
    first, _, rest = path.partition(".")
    if rest:
        raise ValueError(f"nested field .{path}")
    if scope.dot == "root":
        if first not in _ROOT_FIELDS:
            raise ValueError(f"unsupported field .{first}")
        return _ROOT_FIELDS[first]
    if first not in _MESSAGE_FIELDS:
        raise ValueError(f"unsupported message field .{first}")
    return f"{scope.dot}.{_MESSAGE_FIELDS[first]}"


def _text(text: str) -> str:
    """Literal text, with '{' written so that Jinja never reads a tag in it."""
    return text.replace("{", "{{ '{' }}") if "{" in text else text


def _actions(template: str) -> Iterator[tuple[int, int, bool, str, bool]]:
    """Each ``{{ ... }}``: (start, end, trims left, body, trims right). A scan for the next ``}}``
    rather than a lazy regex, which took 35 s on 32 KB of ``{{`` (each one read to the end)."""
    pos = 0
    while (start := template.find("{{", pos)) >= 0:
        end = template.find("}}", start + 2)
        if end < 0:
            raise ValueError("an action {{ is never closed with }}")
        inner = template[start + 2:end]
        left = inner.startswith("-")
        inner = inner[1:] if left else inner
        right = inner.endswith("-")
        yield start, end + 2, left, (inner[:-1] if right else inner).strip(), right
        pos = end + 2


def to_jinja(template: str) -> str:
    """The Jinja equivalent of an Ollama Go template; ValueError for what it cannot convert."""
    out = [_PRELUDE]
    scopes = [_Scope("root", {})]
    blocks: list[str] = []
    pos = 0
    for start, end, left, body, right in _actions(template):
        out.append(_text(template[pos:start]))
        pos = end
        # Go needs a space between '-' and the body; `{{-3}}` is the number -3: rare, not handled.
        # Chat templates render with trim_blocks and lstrip_blocks (Hugging Face's settings, and
        # pagoda's): '+' turns both off per tag, as Go trims nothing unasked.
        lt, rt = ("-" if left else "+"), ("-" if right else "+")
        if body.startswith("/*"):
            out.append(f"{{%{lt} if false +%}}{{%+ endif {rt}%}}")
            continue
        if "|" in re.sub(r'"(?:[^"\\]|\\.)*"|`[^`]*`', "", body):
            raise ValueError(f"{{{{{body}}}}}: pipelines are not supported")
        words = _tokens(body)
        if not words:
            raise ValueError("an empty action")
        head, scope = words[0], scopes[-1]
        if head in ("if", "range") and len(blocks) >= MAX_BLOCK_NESTING:
            raise ValueError(f"{{{{{body}}}}}: blocks nested more than {MAX_BLOCK_NESTING} deep")
        try:
            if head == "if":
                out.append(f"{{%{lt} if {_Expr(words[1:], scope).parse()} {rt}%}}")
                blocks.append("if")
            elif head == "else" and len(words) > 2 and words[1] == "if":
                out.append(f"{{%{lt} elif {_Expr(words[2:], scope).parse()} {rt}%}}")
            elif head == "else" and len(words) == 1:
                out.append(f"{{%{lt} else {rt}%}}")
            elif head == "end":
                if not blocks:
                    raise ValueError("an {{ end }} without a block")
                kind = blocks.pop()
                if kind == "range":
                    scopes.pop()
                out.append(f"{{%{lt} end{kind.replace('range', 'for')} {rt}%}}")
            elif head == "range":
                rest = words[1:]
                variables = dict(scope.variables)
                loop_var = f"m{len(scopes)}"
                if ":=" in rest:
                    names = [w for w in rest[:rest.index(":=")] if w != ","]
                    rest = rest[rest.index(":=") + 1:]
                    if len(names) == 2:
                        variables[names[0]] = "loop.index0"
                        variables[names[1]] = loop_var
                    elif len(names) == 1:
                        variables[names[0]] = loop_var
                    else:
                        raise ValueError("range with more than two variables")
                seq = _Expr(rest, scope).parse()
                if blocks.count("range") >= MAX_RANGE_NESTING:
                    raise ValueError(f"ranges nested more than {MAX_RANGE_NESTING} deep")
                out.append(f"{{%{lt} for {loop_var} in {seq} {rt}%}}")
                blocks.append("range")
                scopes.append(_Scope(loop_var, variables))
            elif head in ("with", "define", "template", "block", "break", "continue"):
                raise ValueError(f"{{{{ {head} }}}} is not supported")
            else:
                out.append(f"{{{{{lt.strip('+')} {_Expr(words, scope).parse()} {rt.strip('+')}}}}}")
        except ValueError as e:
            raise ValueError(f"{{{{{body}}}}}: {e}") from None
    if blocks:
        raise ValueError(f"{len(blocks)} block(s) without {{{{ end }}}}")
    tail = _text(template[pos:])
    if tail.endswith("\n"):  # Jinja drops a final newline (keep_trailing_newline is off); Go keeps it
        tail = tail[:-1] + "{{ '\\n' }}"
    out.append(tail)
    return "".join(out)
