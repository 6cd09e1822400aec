"""Structured output: constrain generation to a JSON schema, regex, choice or grammar (GBNF or Lark).

`grammar.py` turns a StructuredOutputsParams into an llguidance grammar and validates it (cheap,
done on the front end so bad input fails fast with a ValueError). `manager.py` compiles grammars
against the tokenizer off the engine loop, keeps a matcher per request, and builds the token
bitmask the sampler applies.
"""

from pagoda.structured_output.grammar import build_grammar, constraint_key, validate_structured_outputs
from pagoda.structured_output.manager import (
    CompiledGrammar, GrammarState, StructuredOutputManager, apply_token_bitmask, build_token_bitmask, compile_grammar,
)

__all__ = [
    "CompiledGrammar", "GrammarState", "StructuredOutputManager", "apply_token_bitmask", "build_grammar",
    "build_token_bitmask", "compile_grammar", "constraint_key", "validate_structured_outputs",
]
