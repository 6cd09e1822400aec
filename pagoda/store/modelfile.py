"""Ollama's Modelfile: ``FROM``, ``TEMPLATE``, ``SYSTEM``, ``PARAMETER``, ``LICENSE``, ``MESSAGE``.

    # comment
    FROM ./model.gguf            (a GGUF file, a Hugging Face directory, or a model in the store)
    PARAMETER temperature 0.2
    PARAMETER stop "<|im_end|>"  (repeatable: the stops add up)
    TEMPLATE \"\"\"{{ .System }}
    {{ .Prompt }}\"\"\"             (triple quotes span lines)
    SYSTEM "You are terse."
    LICENSE \"\"\"...\"\"\"           (repeatable)
    MESSAGE user Hello
    ADAPTER ./lora.gguf          (a LoRA adapter: a GGUF as llama.cpp writes it, or a PEFT directory)

Instructions are case-insensitive. Every error names the line (``Modelfile line N: ...``). One
ADAPTER per model, as Ollama's runner applies one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ollama's parameters and their types (api.Options / Runner); a list type means repeatable.
PARAMETER_TYPES: dict[str, type] = {
    "num_ctx": int, "num_batch": int, "num_gpu": int, "main_gpu": int, "num_thread": int, "num_keep": int,
    "num_predict": int, "seed": int, "top_k": int, "repeat_last_n": int, "mirostat": int,
    "temperature": float, "top_p": float, "min_p": float, "typical_p": float, "repeat_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "mirostat_tau": float, "mirostat_eta": float,
    "tfs_z": float, "use_mmap": bool, "use_mlock": bool, "numa": bool, "low_vram": bool, "penalize_newline": bool,
    "stop": list,
}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_COMMANDS = ("FROM", "TEMPLATE", "SYSTEM", "PARAMETER", "LICENSE", "MESSAGE", "ADAPTER", "REQUIRES")


class ModelfileError(ValueError):
    def __init__(self, line: int, message: str, source: str = "Modelfile") -> None:
        super().__init__(f"{source} line {line}: {message}")
        self.line = line


@dataclass
class Modelfile:
    from_: str
    from_line: int = 0
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    licenses: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    base_dir: Path | None = None  # where the Modelfile is: FROM paths are relative to it
    adapter: str | None = None  # ADAPTER: a LoRA adapter's file or directory
    adapter_line: int = 0

    def adapter_path(self) -> Path | None:
        """ADAPTER as a path (relative to the Modelfile); None without an ADAPTER line."""
        if self.adapter is None:
            return None
        path = Path(self.adapter).expanduser()
        return self.base_dir / path if not path.is_absolute() and self.base_dir is not None else path

    def from_path(self) -> Path | None:
        """FROM as a local path (relative to the Modelfile), if it names one that exists."""
        path = Path(self.from_).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        return path if path.exists() else None


def parse_modelfile(text: str, *, base_dir: Path | None = None, source: str = "Modelfile") -> Modelfile:
    lines = text.splitlines()
    result: dict[str, Any] = {"template": None, "system": None}
    from_: tuple[str, int] | None = None
    adapter: tuple[str, int] | None = None
    parameters: dict[str, Any] = {}
    licenses: list[str] = []
    messages: list[dict[str, str]] = []
    i = 0
    while i < len(lines):
        lineno = i + 1
        stripped = lines[i].strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        command, _, rest = stripped.partition(" ")
        if "\t" in command:
            command, _, more = command.partition("\t")
            rest = more + " " + rest
        command, rest = command.upper(), rest.strip()
        if command not in _COMMANDS:
            raise ModelfileError(lineno, f"unknown instruction {command!r} (expected one of {', '.join(_COMMANDS)})",
                                 source)
        if command == "PARAMETER":
            name, _, value_text = rest.partition(" ")
            name = name.strip().lower()
            if not name:
                raise ModelfileError(lineno, "PARAMETER needs a name and a value", source)
            value, i = _value(value_text.strip(), lines, i, lineno, source)
            _set_parameter(parameters, name, value, lineno, source)
            continue
        if command == "MESSAGE":
            role, _, content_text = rest.partition(" ")
            role = role.strip().lower()
            if role not in MESSAGE_ROLES:
                raise ModelfileError(lineno, f"MESSAGE role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                                     source)
            content, i = _value(content_text.strip(), lines, i, lineno, source)
            messages.append({"role": role, "content": content})
            continue
        value, i = _value(rest, lines, i, lineno, source)
        if command == "FROM":
            if from_ is not None:
                raise ModelfileError(lineno, f"a second FROM (the first is on line {from_[1]})", source)
            if not value.strip():
                raise ModelfileError(lineno, "FROM needs a model: a GGUF file, a model directory or a model name",
                                     source)
            from_ = (value.strip(), lineno)
        elif command in ("TEMPLATE", "SYSTEM"):
            result[command.lower()] = value
        elif command == "LICENSE":
            licenses.append(value)
        elif command == "ADAPTER":
            if adapter is not None:
                raise ModelfileError(lineno, f"a second ADAPTER (the first is on line {adapter[1]}): one adapter "
                                     "a model", source)
            if not value.strip():
                raise ModelfileError(lineno, "ADAPTER needs a LoRA adapter: a .gguf file or a PEFT directory", source)
            adapter = (value.strip(), lineno)
        # REQUIRES (a minimum Ollama version) is accepted and ignored.
    if from_ is None:
        raise ModelfileError(max(len(lines), 1), "no FROM instruction: the Modelfile must name the model it builds on",
                             source)
    return Modelfile(from_[0], from_[1], result["template"], result["system"], parameters, licenses, messages,
                     base_dir, *(adapter or (None, 0)))


def _value(text: str, lines: list[str], i: int, lineno: int, source: str) -> tuple[str, int]:
    """One value: triple-quoted (may span lines), double-quoted, or the rest of the line."""
    if text.startswith('"""'):
        body = text[3:]
        end = body.find('"""')
        if end >= 0:
            trailing = body[end + 3:].strip()
            if trailing:
                raise ModelfileError(lineno, f"text after the closing \"\"\": {trailing!r}", source)
            return body[:end], i
        parts = [body]
        while i < len(lines):
            line = lines[i]
            i += 1
            end = line.find('"""')
            if end >= 0:
                trailing = line[end + 3:].strip()
                if trailing:
                    raise ModelfileError(i, f"text after the closing \"\"\": {trailing!r}", source)
                parts.append(line[:end])
                return "\n".join(parts), i
            parts.append(line)
        raise ModelfileError(lineno, 'unterminated """ (no closing """ before the end of the file)', source)
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise ModelfileError(lineno, 'unterminated "', source)
        return text[1:-1].replace('\\"', '"'), i
    return text, i


def _set_parameter(parameters: dict[str, Any], name: str, value: str, lineno: int, source: str) -> None:
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ModelfileError(lineno, f"unknown parameter {name!r}", source)
    if value == "":
        raise ModelfileError(lineno, f"PARAMETER {name} needs a value", source)
    if kind is list:
        parameters.setdefault(name, []).append(value)
        return
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError
            parameters[name] = value.lower() == "true"
        else:
            parameters[name] = kind(value)
    except ValueError:
        raise ModelfileError(lineno, f"PARAMETER {name} must be {'an integer' if kind is int else 'a number' if kind is float else 'true or false'}, got {value!r}",
                             source) from None


def read_modelfile(path: Path) -> Modelfile:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"Modelfile not found: {path}") from None
    return parse_modelfile(text, base_dir=path.resolve().parent, source=str(path))
