"""The pooling routes' bodies (pydantic): OpenAI's embeddings, vLLM's score, the Jina / Cohere
rerank as vLLM serves it, with vLLM's extension fields. Inputs are checked by hand, as the
completions prompt is (protocol.py): a pydantic union of long lists is slow to refuse."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator

from pagoda.entrypoints.input_limits import MAX_PROMPTS, check_count
from pagoda.entrypoints.openai.protocol import Int64, RequestBody
from pagoda.pooling_params import PoolingParams


def _texts(field: str, allow_ids: bool):
    """A validator: a string or a non-empty list of strings (and with ``allow_ids``, token ids or
    lists of them), at most MAX_PROMPTS of them, none empty."""
    forms = "a string or a list of strings" + (", token ids, or a list of token-id lists" if allow_ids else "")

    def check(value: Any):
        if isinstance(value, str):
            items = [value]
        elif isinstance(value, list) and value:
            if allow_ids and all(type(x) is int for x in value):
                return value
            check_count(value, field, MAX_PROMPTS, "inputs")
            items = value
            ok = all(isinstance(x, str) for x in value) or (
                allow_ids and all(isinstance(x, list) and all(type(t) is int for t in x) for x in value))
            if not ok:
                raise ValueError(f"{field} must be {forms}")
        elif isinstance(value, list):
            raise ValueError(f"{field} is empty: give at least one input")
        else:
            raise ValueError(f"{field} must be {forms}")
        if any(len(x) == 0 for x in items):
            raise ValueError(f"{field} holds an empty input: every input needs at least one token")
        return value

    return check


Input = Annotated[str | list[str] | list[int] | list[list[int]],
                  PlainValidator(_texts("input", True), json_schema_input_type=str | list[str] | list[Int64]
                                 | list[list[Int64]])]
Text1 = Annotated[str | list[str], PlainValidator(_texts("text_1", False), json_schema_input_type=str | list[str])]
Text2 = Annotated[str | list[str], PlainValidator(_texts("text_2", False), json_schema_input_type=str | list[str])]
Documents = Annotated[list[str], PlainValidator(_texts("documents", False), json_schema_input_type=list[str])]


class PoolingFields(RequestBody):
    """What every pooling body may say (vLLM's extensions)."""

    model: str | None = None
    user: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None

    def pooling_params(self, task: str, **more) -> PoolingParams:
        return PoolingParams(task=task, truncate_prompt_tokens=self.truncate_prompt_tokens, **more)


class EmbeddingRequest(PoolingFields):
    """POST /v1/embeddings (OpenAI's body; ``normalize`` is vLLM's)."""

    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: bool | None = None


class ScoreRequest(PoolingFields):
    """POST /v1/score (vLLM's): ``text_1`` against each ``text_2``, or the two lists pair by pair."""

    text_1: Text1
    text_2: Text2


class RerankRequest(PoolingFields):
    """POST /v1/rerank, /rerank, /v2/rerank (Jina's and Cohere's body, as vLLM serves it)."""

    query: str = Field(min_length=1)
    documents: Documents
    top_n: Int64 | None = None
    return_documents: bool = True
