"""The `pagoda` command as a user runs it (a real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

from pagoda import LLM, SamplingParams


def _run(args: list[str], input_text: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", *args], input=input_text,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_streams_the_greedy_completion(tiny_llama):
    proc = _run(["generate", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.01",
                 "--temperature", "0", "--max-tokens", "12", "The quick brown fox"])
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.01)
    expected = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == expected + "\n"


def test_chat_keeps_the_conversation(tiny_llama):
    proc = _run(["chat", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.01",
                 "--temperature", "0", "--max-tokens", "5"], input_text="Hello\nAnd again\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    # The second answer sees the first turn: replay the conversation through the Python API.
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.01)
    params = SamplingParams(temperature=0, max_tokens=5)
    first = llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "And again"}], params, use_tqdm=False)[0].outputs[0].text
    assert proc.stdout.count(">>> ") == 3
    assert first in proc.stdout and second in proc.stdout


def test_errors_are_one_clear_line(tiny_llama, tmp_path):
    proc = _run(["generate", "--model", "definitely-not-a-model", "hi"])
    assert proc.returncode == 1
    assert proc.stderr.startswith("pagoda: error: model 'definitely-not-a-model' not found")
    assert "Traceback" not in proc.stderr
    proc = _run(["generate", "--model", str(tiny_llama), "--max-tokens", "0", "hi"])
    assert proc.returncode == 1 and "max_tokens must be an integer >= 1" in proc.stderr


def test_list_shows_the_catalog(tmp_path):
    env_home = {"PAGODA_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "list"], capture_output=True, text=True,
                          env=dict(os.environ, **env_home), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m-instruct" in proc.stdout and "gemma3-270m" in proc.stdout
    assert " no " in proc.stdout  # nothing pulled in an empty store


def test_serve_fails_clearly_before_listening(tiny_llama):
    proc = _run(["serve", "--model", "definitely-not-a-model", "--port", "1"])
    assert proc.returncode == 1 and "model 'definitely-not-a-model' not found" in proc.stderr
    proc = _run(["serve", "--model", str(tiny_llama), "--tensor-parallel-size", "2"])
    assert proc.returncode == 1 and "tensor_parallel_size > 1 is not supported yet" in proc.stderr
