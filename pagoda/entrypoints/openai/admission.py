"""Whether a request is let in, before it reaches the engine: the model it names, the server's
queue limit (`--max-queue-len`) and the tenant's, the context it needs (prompt and max_tokens),
text too long to tokenize, and the content filter on its input. A refusal is an OpenAIError
(400, 403, 404 or 429) that names the problem."""

from __future__ import annotations

from contextvars import ContextVar

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.lora.request import LoRARequest
from pagoda.security.context import (
    request_context,  # --auth-config / --audit-log (pagoda/security/access.py)
)

# Set in a batch line's task (batch_runner.py): its requests are background work, which waits in
# the engine's queue below interactive requests instead of counting against --max-queue-len.
BACKGROUND_WORK: ContextVar[bool] = ContextVar("pagoda_background_work", default=False)


class Admission:
    """What one HTTP request holds of the engine-level limit (Serving.check_capacity), given back
    once when its answer is done (api_server.respond)."""

    def __init__(self, serving: AdmissionChecks) -> None:
        self.serving, self.held = serving, 0
        self.tenant_slot = None  # auth: the RequestContext holding a tenant's concurrency slot

    def take(self, n: int) -> None:
        self.serving.admitted += n
        self.held += n

    def release(self) -> None:
        self.serving.admitted -= self.held
        self.held = 0
        if self.tenant_slot is not None:
            self.tenant_slot.release()
            self.tenant_slot = None


class AdmissionChecks:
    """Serving's checks (a part of `Serving`: the attributes are its own)."""

    def check_model(self, model: str | None) -> str:
        """The served name for a request's `model` (any accepted name; none means the served one).
        A LoRA adapter's name is served as itself, and the request runs under it (lora_routes.py)."""
        ctx = request_context()  # auth: the role may use this name (403; the 404 lists only those), the audit's model
        if self.adapters is not None and self.adapters.get(model) is not None:
            if ctx is not None:
                ctx.check_model(model)
            return model
        if model is None or model in self.accepted_names:
            if ctx is not None:
                ctx.check_model(model or self.model_names[0])
            return self.model_names[0]
        served = [*self.accepted_names, *(self.adapters.by_name if self.adapters is not None else ())]
        names = ", ".join(f"`{name}`" for name in (ctx.visible(served) if ctx else served))
        raise OpenAIError(f"The model `{model}` does not exist. This server serves {names}.", status=404,
                          type_="NotFoundError", param="model", code="model_not_found")

    def adapter_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, looked up as the request starts (a swap
        before then gives it the new version); None for the base model. An adapter unloaded since
        ``check_model`` is a 404, never a silent run on the base."""
        if self.adapters is None or not model or model in self.accepted_names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise OpenAIError(f"The model `{model}` does not exist (the LoRA adapter was unloaded).", status=404,
                              type_="NotFoundError", param="model", code="model_not_found")
        return adapter

    def admission(self) -> Admission:
        return Admission(self)

    def check_capacity(self, new_requests: int, admission: Admission | None = None) -> None:
        """The engine-level limit (`--max-queue-len`): up to `--max-num-seqs` requests run and at
        most `--max-queue-len` more wait; past that, 429 at once instead of an unbounded queue.
        Counted as requests admitted (running + waiting) against the sum of the two, settled the
        moment a request arrives: a burst waits in the engine's queue until the next step
        schedules it, so "waiting" alone would refuse requests that can run. The count is the
        HTTP requests admitted and not yet answered (`admission` takes its share at once), not
        the engine's: a request reaches the engine a few awaits after this check, and a burst
        that arrives in one go would all pass a check of the engine's count."""
        ctx = request_context()
        if ctx is not None and admission is not None and admission.tenant_slot is None:
            ctx.admit()  # auth: the tenant's max_concurrent and tokens_per_minute (429), held to the end
            admission.tenant_slot = ctx
        if self.max_queue_len is None or BACKGROUND_WORK.get():
            return  # a batch line waits below every request instead of being refused
        running = self.engine.config.scheduler.max_num_seqs
        # batch lines (self.background) wait below every interactive request: they take no room
        pending = max(self.admitted, self.engine.num_pending - self.background)
        if pending + new_requests > running + self.max_queue_len:
            raise OpenAIError(f"the server is full ({running} requests running, --max-num-seqs, and "
                              f"{self.max_queue_len} waiting, --max-queue-len); retry later", status=429,
                              type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if admission is not None:
            admission.take(new_requests)

    def max_tokens_for(self, requested: int | None, prompt_len: int, prompt_param: str = "prompt") -> int:
        """The completion's token budget. A prompt that leaves no room is the prompt's fault (param
        `prompt`, or `messages` for chat) whatever max_tokens says; max_tokens is named only when
        the prompt fits but the two together do not."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"{_subject(prompt_param)} {prompt_len} tokens, leaving no room to generate. Please "
                              f"shorten the {prompt_param}.", param=prompt_param, code="context_length_exceeded")
        ctx = request_context()
        cap = ctx.check_max_tokens(requested) if ctx is not None else None  # auth: the role's max_tokens (400 past it)
        if requested is None and cap is not None:  # ... and the default within it
            return min(room, cap, self.sampling_defaults.get("max_tokens", cap))
        if requested is None:  # the model's default (generation_config max_new_tokens), else all the room
            return min(room, self.sampling_defaults.get("max_tokens", room))
        if requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
                "Please reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
        return requested

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest vocabulary entry (a byte-level
        entry has one character per byte, so it never covers more characters than its length)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.convert_ids_to_tokens(range(self.tokenizer.vocab_size))
            self._max_token_chars = max(max(map(len, vocab), default=1), 1)
        return self._max_token_chars

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, text longer than the whole context could hold even if every
        token were the longest in the vocabulary: tokenizing a 10 MB prompt held the event loop for
        ~12 s only to find it too long. Text within the bound costs at most that many characters of
        tokenizing (3.3k on the tiny test model; ~8k tokens x the longest entry for a real one)."""
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"{_subject(param)} {num_chars} characters, more than {self.max_model_len} tokens can "
                              f"hold (at most {limit}). Please shorten the {param}.", param=param,
                              code="context_length_exceeded")

    def check_input(self, texts, param: str = "prompt") -> None:
        """The content filter on a request's text, before it is tokenized: a term of a word list
        is a 400 `content_filter` that names the list, not the text."""
        moderation = self.moderation.for_request() if self.moderation is not None else None
        name = moderation.check_input(texts) if moderation is not None else None
        if name is not None:
            raise OpenAIError(f"the {param} was refused by the content filter: it holds a term of the word list "
                              f"`{name}`", param=param, code="content_filter")

def _subject(param: str) -> str:
    return "the messages have" if param == "messages" else f"the {param} has"
