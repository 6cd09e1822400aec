"""Offline inference in vLLM's shape: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from pagoda.config import DEFAULT_MODEL, EngineArgs
from pagoda.engine.beam_search import BeamSearch, BeamSearchOutput, step_params
from pagoda.engine.content_filter import Moderation
from pagoda.engine.input_processor import PromptType
from pagoda.lora.request import LoRARequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.multimodal.processor import chat_images
from pagoda.engine.scoring import cosine, score_pairs
from pagoda.outputs import PoolingRequestOutput, RequestOutput, ScoringOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM(model="smollm2")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, moderation_words: Sequence[str] | None = None,
                 moderation_action: str = "stop", **kwargs) -> None:
        """`moderation_words` (word-list files, as `pagoda serve --moderation-words`): prompts that
        hold a term raise ContentFilterError, and output is filtered as it is generated (a choice
        stopped with finish_reason "content_filter", or with `moderation_action="mask"` the term
        masked); pagoda.lang's in-process Engine takes the same keywords."""
        moderation = None
        if moderation_words:
            moderation = Moderation.from_files(moderation_words, moderation_action)
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        # An offline engine returns loaded, as before: what it gains from loading layer by layer is
        # the tokenizer and KV cache set up meanwhile (a server takes requests during the load).
        self.engine.core.wait_until_loaded()
        self.engine.moderation = moderation
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (with tensor parallelism); they also stop when
        the LLM is garbage-collected or the interpreter exits."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: the LoRA adapter every prompt runs under, or one per prompt (vLLM's)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(request_id)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            conv, images = chat_images(conv, self.engine.input_processor.images)  # vLLM's image parts
            text = tokenizer.apply_chat_template(conv, add_generation_prompt, **(chat_template_kwargs or {}))
            ids = self.engine.input_processor.images.from_text(text, images, add_special_tokens=False) if images \
                else tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's `LLM.beam_search` (engine/beam_search.py): each prompt's best
        `beam_width` sequences, best first, each with `tokens` (the prompt's, then the generated
        ones), `text` (all of them decoded, special tokens kept), `cum_logprob`, `finish_reason`.
        Every step runs the live beams of all prompts as one batch of one-token requests."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        eos = set(self.engine.tokenizer.eos_token_ids)
        searches = [BeamSearch(self.engine.input_processor.tokenize_prompt(p)[1], params, eos, self.engine.max_model_len)
                    for p in prompts]
        one_token = step_params(params)
        with tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm) as bar:
            while active := [s for s in searches if not s.done]:
                beams = [beam for s in active for beam in s.live]
                outs = iter(self.generate([{"prompt_token_ids": b.tokens} for b in beams], one_token, use_tqdm=False))
                for s in active:
                    s.advance([next(outs).outputs[0].logprobs[0] for _ in s.live])
                bar.update(1)
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = self.engine.tokenizer.decode(beam.tokens, skip_special_tokens=False)
            results.append(BeamSearchOutput(best))
        return results

    # -- the pooling runner (runner="pooling", or an embedding model) ------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector (``outputs.data``, a float32 tensor), in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        ids = []
        try:
            for prompt in prompts:
                request_id = str(next(self._ids))
                self.engine.add_pooling_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm, "Embedding")

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeddings (vLLM's ``LLM.embed``): ``outputs.embedding`` is each prompt's vector as floats."""
        return self.encode(prompts, pooling_params or PoolingParams(task="embed"), use_tqdm=use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.score`` (``outputs.score``): a cross-encoder's score of each pair, else the
        cosine similarity of the pair's vectors; one ``text_1`` is scored against every
        ``text_2``, or two lists pair by pair."""
        pairs = score_pairs(text_1, text_2)
        if self.engine.config.model.cross_encoder:  # each pair one prompt, scored by the model's head
            tokenizer = self.engine.tokenizer
            outs = self.encode([{"prompt_token_ids": tokenizer.encode_pair(a, b)} for a, b in pairs],
                               PoolingParams(task="score"), use_tqdm=use_tqdm)
            return [PoolingRequestOutput(f"score-{i}", ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for i, o in enumerate(outs)]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text embedded once
        vectors = dict(zip(texts, self.encode(texts, PoolingParams(task="score"), use_tqdm=use_tqdm)))
        return [PoolingRequestOutput(f"score-{i}", ScoringOutput(cosine(vectors[a].outputs.data, vectors[b].outputs.data)),
                                     vectors[a].prompt_token_ids + vectors[b].prompt_token_ids)
                for i, (a, b) in enumerate(pairs)]

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling parameters uses: the model's generation_config defaults
        (`generation_config="vllm"` turns them off), else SamplingParams' own."""
        return SamplingParams(**self.engine.sampling_defaults)

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list:
        results: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm or len(ids) < 2, dynamic_ncols=True)
        try:
            for out in self.engine.outputs():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
            if len(results) < len(ids):
                raise RuntimeError("the engine stopped before every request finished")
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
