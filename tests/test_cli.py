"""The `pagoda` command as a user runs it (a real subprocess)."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from pagoda import LLM, SamplingParams, __version__
from pagoda.entrypoints import served_models
from pagoda.cli import build_parser, resolve_log_level
from server_process import OpenStream, _free_port


def _run(args: list[str], input_text: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "pagoda.cli", *args], input=input_text,
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
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli", "list"], capture_output=True, text=True,
                          env=dict(os.environ, **env_home), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m-instruct" in proc.stdout and "gemma3-270m" in proc.stdout
    assert " no " in proc.stdout  # nothing pulled in an empty store
    kinds = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith(("smollm2", "gemma3"))}
    assert "base: completions" in kinds["gemma3-270m"] and " chat " in kinds["smollm2-135m-instruct"]


def test_serve_fails_clearly_before_listening(tiny_llama):
    proc = _run(["serve", "--model", "definitely-not-a-model", "--port", "1"])
    assert proc.returncode == 1 and "model 'definitely-not-a-model' not found" in proc.stderr
    proc = _run(["serve", "--model", str(tiny_llama), "--port", str(_free_port()), "--tensor-parallel-size", "3"])
    assert proc.returncode == 1 and "tensor_parallel_size=3 must divide the model's 4 attention heads" in proc.stderr


def test_serve_takes_the_model_once_as_a_positional_or_with_model():
    parser = build_parser()
    ns = parser.parse_args(["serve", "smollm2", "--port", "9000"])
    served_models.apply_model_tag(ns)
    assert (ns.model, ns.models, ns.port) == ("smollm2", ["smollm2"], 9000)
    proc = _run(["serve", "gemma3-270m", "--model", "smollm2", "--port", "1"], timeout=60)
    assert proc.returncode == 1 and "the model is given twice: as 'gemma3-270m' and with --model" in proc.stderr


def test_version_names_the_package():
    proc = _run(["--version"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"pagoda {__version__}\n"
    assert __version__ == importlib.metadata.version("pagoda")


def test_help_imports_nothing_heavy_and_shows_defaults():
    """`pagoda --help` used to import torch through pagoda.config (~2 s); now the parser is
    built from light modules only, bench's options included until `bench` is used."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagoda.cli", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "serve" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    heavy = {"torch", "transformers", "fastapi", "uvicorn", "numpy", "ray", "pagoda.config", "pagoda.bench"}
    assert not heavy & imported
    serve_help = _run(["serve", "--help"], timeout=60).stdout
    assert "(default: 8000)" in serve_help and "(default: 127.0.0.1)" in serve_help
    assert "(default: smollm2-135m-instruct)" in serve_help and "(default: on)" in serve_help
    assert "(default: False)" not in serve_help  # plain flags say nothing
    assert "--ray-serve" in serve_help and "--target-ongoing-requests" in serve_help  # pagoda/ray_serve/options.py
    bench_help = _run(["bench", "throughput", "--help"], timeout=60)
    assert bench_help.returncode == 0 and "(default: 256)" in bench_help.stdout  # --max-num-seqs


def test_cli_default_model_is_the_engines():
    from pagoda.config import DEFAULT_MODEL

    assert build_parser().parse_args(["generate", "hi"]).model == DEFAULT_MODEL


@pytest.mark.parametrize(("argv", "level"), [
    (["serve"], "info"),
    (["generate", "hi"], "warning"),
    (["--log-level", "debug", "serve"], "debug"),
    (["--log-level", "error", "generate", "hi"], "error"),
    (["--log-level", "debug", "serve", "--log-level", "warning"], "warning"),
    (["serve", "--log-level", "error"], "error"),
])
def test_log_level_explicit_command_option_then_global_then_default(argv, level):
    assert resolve_log_level(build_parser().parse_args(argv)) == level


def _serve_then_stop(args: list[str], model, request: dict | None = None,
                     stop: signal.Signals = signal.SIGTERM) -> subprocess.CompletedProcess:
    """Start `pagoda <args> serve MODEL`, wait for /health, optionally POST one completion
    request (its status must be 200), then stop the server with a signal; stdout and stderr."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", *args, "serve", str(model), "--port", str(port),
           "--dtype", "float32", "--kv-cache-memory", "0.01"]  # the model as `vllm serve MODEL` takes it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        if request is not None:
            response = httpx.post(f"{base}/v1/completions", json={"model": str(model), **request}, timeout=60)
            assert response.status_code == 200, response.text
        proc.send_signal(stop)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_global_log_level_reaches_serve(tiny_llama):
    """`pagoda --log-level debug serve` used to run at serve's default (info): no debug line."""
    proc = _serve_then_stop(["--log-level", "debug"], tiny_llama)
    assert "pagoda: serving on" in proc.stdout, proc.stdout + proc.stderr
    assert any(line.startswith("DEBUG") for line in proc.stderr.splitlines()), proc.stderr


def test_server_with_structured_outputs_exits_cleanly(tiny_llama):
    """Every server exit used to print ~27 lines of "nanobind: leaked ..." (triton's bindings,
    kept alive past the final collection by the server's gc.freeze())."""
    proc = _serve_then_stop([], tiny_llama, stop=signal.SIGINT,
                            request={"prompt": "hi", "max_tokens": 5, "structured_outputs": {"regex": "[ab]+"}})
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr and "nanobind" not in proc.stderr, proc.stderr


def test_llm_script_with_structured_outputs_exits_cleanly(tiny_llama):
    script = textwrap.dedent(f"""
        from pagoda import LLM, SamplingParams
        from pagoda.sampling_params import StructuredOutputsParams

        llm = LLM(model={str(tiny_llama)!r}, dtype="float32", kv_cache_memory=0.01)
        params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
        print(llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].text)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.strip()) <= {"a", "b"} and proc.stdout.strip()
    assert "leaked" not in proc.stderr and "nanobind" not in proc.stderr, proc.stderr


def test_chat_reset_forgets_and_says_so(tiny_llama):
    proc = _run(["chat", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.01",
                 "--temperature", "0", "--max-tokens", "5"], input_text="Hello\n/reset\nHello\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "conversation reset" in proc.stderr
    replies = [part.split("\n", 1)[0] for part in proc.stdout.split(">>> ")[1:] if part.strip()]
    assert len(replies) == 2 and replies[0] == replies[1]  # the second "Hello" starts afresh


def test_a_second_ctrl_c_stops_serve_at_once_without_a_traceback(long_tiny_llama, tmp_path):
    """The second signal aborts everything and exits; it used to end with uvicorn's lifespan task
    cancelled under it, printing a CancelledError traceback."""
    port, log = _free_port(), (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", str(long_tiny_llama), "--port",
                             str(port), "--dtype", "float32", "--kv-cache-memory", "0.05", "--max-model-len", "16384",
                             "--served-model-name", "tiny", "--shutdown-timeout", "600"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(f"{base}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        stream = OpenStream(base)
        stream.wait_started()
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "SIGINT: shutting down" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, "no drain in the log"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # far sooner than the 600 s drain
        output = (tmp_path / "serve.log").read_text()
        assert "SIGINT again: aborting 1 request(s) and exiting now" in output
        assert "Traceback" not in output and "CancelledError" not in output, output
        assert stream.join().error_code() == "shutting_down"
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
