"""`--dtype auto` on a CPU is measured once (fp32 against bf16) and then read from its file."""

from __future__ import annotations

import json
import logging

import torch

from pagoda.layers import dtype_choice
from pagoda.dtypes import resolve_dtype


def test_the_measurement_times_both_dtypes_and_follows_its_rule():
    record = dtype_choice.measure()
    ms = record["ms"]
    for dtype in ("float32", "bfloat16"):
        assert set(ms[dtype]) == {str(m) for m in dtype_choice.ROWS}
        assert all(t > 0 for t in ms[dtype].values())
    faster = all(ms["bfloat16"][str(m)] * dtype_choice.MARGIN < ms["float32"][str(m)] for m in dtype_choice.ROWS)
    assert record["choice"] == ("bfloat16" if faster else "float32")


def test_auto_measures_once_then_reads_the_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    path = dtype_choice.choice_path()
    assert not path.exists()
    with caplog.at_level(logging.INFO, logger="pagoda.layers.dtype_choice"):
        first = dtype_choice.auto_cpu_dtype()
    assert "measured now" in caplog.text
    # the measurement says it starts before it runs (a first start is otherwise silent for it)
    assert caplog.text.index("timing fp32 against bf16") < caplog.text.index("measured now")
    record = json.loads(path.read_text())
    assert first == {"float32": torch.float32, "bfloat16": torch.bfloat16}[record["choice"]]
    assert resolve_dtype("auto", torch.device("cpu")) == first

    # a later start reads the file: what it says is what auto means
    for choice, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        path.write_text(json.dumps({**record, "choice": choice}))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagoda.layers.dtype_choice"):
            assert resolve_dtype("auto", torch.device("cpu")) == dtype
        assert "measured before" in caplog.text

    # a file from another torch (or an older measurement) is measured again
    path.write_text(json.dumps({**record, "torch": "0.0", "choice": "bfloat16"}))
    dtype_choice.auto_cpu_dtype()
    assert json.loads(path.read_text())["torch"] == torch.__version__
