"""A small Python client for pagoda's gRPC service (`pagoda serve --grpc-port P`):

    from pagoda.client import EngineClient

    with EngineClient("127.0.0.1:50051", api_key=...) as client:
        for piece in client.generate("Once upon a time", max_tokens=32, temperature=0):
            print(piece.text, end="", flush=True)
        print(client.complete("2 + 2 =", max_tokens=4))
        print(client.tokenize("hello"), client.list_models())
        vectors = client.embed(["a text", "another"])  # an embedding model's (--runner pooling)

Sampling keywords are SamplingOptions' fields (pagoda.proto): max_tokens, temperature, top_p,
top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, seed, stop,
stop_token_ids, min_tokens, ignore_eos, logprobs, priority, cache_salt, speculative,
json_schema, regex, choice. Errors are `grpc.RpcError`s with the server's status code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc

from pagoda.entrypoints.grpc_api import pagoda_pb2 as pb
from pagoda.entrypoints.grpc_api import pagoda_pb2_grpc as pb_grpc


class EngineClient:
    def __init__(self, target: str, api_key: str | None = None, timeout: float | None = None) -> None:
        """``target``: host:port of the gRPC service; ``timeout``: each call's deadline, seconds."""
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout

    def generate(self, prompt: str | list[int], model: str = "", **sampling) -> Iterator[pb.GenerateResponse]:
        """The answer's pieces as they are generated (the last has finish_reason and usage)."""
        request = pb.GenerateRequest(model=model, sampling=pb.SamplingOptions(**sampling))
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        return self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout)

    def complete(self, prompt: str | list[int], model: str = "", **sampling) -> str:
        return "".join(piece.text for piece in self.generate(prompt, model, **sampling))

    def chat(self, messages: list[dict], model: str = "", *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, response_format: dict | None = None,
             **sampling) -> Iterator[pb.GenerateResponse]:
        """Messages in the HTTP API's shape (tool calls and tool results included; a message's
        ``images``: encoded image files, for a vision-language model); tools,
        tool_choice and response_format as there. With tools, the last piece has `tool_calls`."""
        request = pb.ChatRequest(model=model, sampling=pb.SamplingOptions(**sampling),
                                 messages=[_chat_message(m) for m in messages])
        for name, value in (("tools", tools), ("tool_choice", tool_choice), ("response_format", response_format)):
            if value is not None:
                setattr(request, f"{name}_json", json.dumps(value))
        return self.stub.Chat(request, metadata=self.metadata, timeout=self.timeout)

    def tokenize(self, text: str, model: str = "", add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(model=model, prompt=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, metadata=self.metadata, timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: list[int], model: str = "") -> str:
        request = pb.DetokenizeRequest(model=model, token_ids=token_ids)
        return self.stub.Detokenize(request, metadata=self.metadata, timeout=self.timeout).text

    def embed(self, texts: str | list[str], model: str = "", *, dimensions: int | None = None,
              normalize: bool | None = None, truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        """Each text's vector (an embedding model's, or a model served with --runner pooling)."""
        request = pb.EmbedRequest(model=model, input=[texts] if isinstance(texts, str) else list(texts),
                                  dimensions=dimensions, normalize=normalize,
                                  truncate_prompt_tokens=truncate_prompt_tokens)
        answer = self.stub.Embed(request, metadata=self.metadata, timeout=self.timeout)
        return [list(e.values) for e in answer.embeddings]

    def list_models(self) -> list[str]:
        answer = self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata, timeout=self.timeout)
        return [m.id for m in answer.models]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chat_message(message: dict) -> pb.ChatMessage:
    calls = [pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    return pb.ChatMessage(role=message["role"], content=message.get("content") or "",
                          tool_call_id=message.get("tool_call_id") or "", tool_calls=calls,
                          images=list(message.get("images") or ()))  # encoded image files (bytes)
