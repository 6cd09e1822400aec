"""pagoda: an LLM inference engine with a paged KV cache and continuous batching."""

from pagoda.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import pagoda` stays light.
    if name == "LLM":
        from pagoda.engine.llm import LLM  # deferred: loads llguidance, tokenizers, torch, tqdm

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "PoolingParams", "PoolingRequestOutput", "__version__"]
