"""How the loader builds a model (pagoda/loader/model_loader.py): on the meta device, then CPU
storage through torch.empty, without importing torch's compiler stack (torch._dynamo, sympy) into a
process that serves and never compiles: they were ~2 s of every start (benchmarks/README.md,
"Start-up time")."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import nn

from pagoda.loader.model_loader import _materialize_on_cpu

CHILD = """
import json, sys
import pagoda.entrypoints.openai.api_server  # what `pagoda serve` imports
from pagoda import LLM, SamplingParams
out = LLM(sys.argv[1], dtype="float32", kv_cache_memory=0.01).generate(["hi"], SamplingParams(max_tokens=2))
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids),
                  "heavy": sorted(m for m in ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes")
                                  if m in sys.modules)}))
"""


def test_meta_model_gets_cpu_storage_keeping_shared_tensors_and_buffer_kinds():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight  # one parameter in two modules
        model[0].register_buffer("table", torch.empty(3), persistent=False)
        model[1].register_buffer("kept", torch.empty(2))
    _materialize_on_cpu(model)
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert model[0].weight is model[1].weight and isinstance(model[0].weight, nn.Parameter)
    assert sorted(model.state_dict()) == ["0.bias", "0.weight", "1.bias", "1.kept", "1.weight"]


def test_serving_a_model_imports_no_compiler_stack(tiny_llama):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tokens": 2, "heavy": []}
