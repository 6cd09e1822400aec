"""`pagoda tune` on the tiny model: real servers, real load; the chosen setting, started afresh from
the config file the tuner wrote (`pagoda serve --config`), meets the SLOs it was tuned for.

The ITL SLO is set from this machine's own speed, measured first (one server at 8 clients): the
machines differ by 2-5x (at 64 clients ITL p99 was 29 ms on an AVX-512 EPYC, over 50 ms on the
Sapphire Rapids), so a fixed SLO either excluded no level on a fast machine or every level on a
slow one. At ITL_FACTOR times the 8-client ITL p99, with 50 % headroom (a trial must stay within
half of it), it holds at low concurrency and is passed somewhere below 64 clients (ITL grows
~5x from 8 to 64 clients), so some levels miss it and the choice matters (asserted, so the test
can fail); the chosen level still has 2x room in the fresh run.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys

import pytest

from pagoda.bench import datasets, serve, servers
from pagoda import cli
from pagoda.tune.search import Budget, Search
from pagoda.tune.setting import Setting
from pagoda.tune.trial import Level, Slos, Trial, search_load

TTFT_SLO_MS = 1000.0
ITL_FACTOR = 4.0  # the ITL SLO, in units of this machine's ITL p99 at 8 clients
MIN_ITL_SLO_MS = 20.0
INPUT_LEN, OUTPUT_LEN = 32, 16


def _load(url: str, model_dir, concurrency: int) -> dict:
    """`pagoda bench serve`'s summary of 2 x concurrency requests at ``concurrency`` clients."""
    tokenizer = datasets.load_tokenizer(str(model_dir))
    requests = datasets.random_requests(max(4, 2 * concurrency), INPUT_LEN, OUTPUT_LEN, tokenizer=tokenizer)
    cfg = serve.ServeConfig(base_url=url, max_concurrency=concurrency, request_rate=math.inf)
    summary, _ = asyncio.run(serve.benchmark(cfg, requests, tokenizer=tokenizer, percentiles=(99.0,)))
    assert summary["failed"] == 0 and summary["completed"] == len(requests)
    return summary


@pytest.fixture(scope="module")
def itl_slo_ms(tiny_llama) -> float:
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tiny_llama), "--dtype", "float32",
           "--kv-cache-memory", "0.02", "--port", str(port), "--log-level", "warning"]
    with servers.running(cmd, port) as url:
        return max(MIN_ITL_SLO_MS, ITL_FACTOR * _load(url, tiny_llama, 8)["p99_itl_ms"])


@pytest.fixture(scope="module")
def tuned(tiny_llama, tmp_path_factory, itl_slo_ms):
    out = tmp_path_factory.mktemp("tune")
    argv = ["tune", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.02",
            "--slo-ttft-p99", f"{TTFT_SLO_MS:g}ms", "--slo-itl-p99", f"{itl_slo_ms:.1f}ms", "--slo-headroom", "0.5",
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--knobs", "quantization,max-num-seqs", "--budget-trials", "3",
            "--start-concurrency", "8", "--max-concurrency", "64",
            "-o", str(out / "best.yaml"), "--plot", str(out / "trials.png"), "--save-result", str(out / "trials.json")]
    assert cli.main(argv) == 0
    return out


def test_the_chosen_setting_meets_the_slos_in_a_fresh_run(tuned, tiny_llama, itl_slo_ms):
    record = json.loads((tuned / "trials.json").read_text())
    levels = [lv for t in record["trials"] for lv in t["levels"]]
    assert any(lv["missed"] for lv in levels), "the SLOs excluded no load level: they test nothing"
    assert 1 <= len(record["trials"]) <= 3
    best = next(t for t in record["trials"] if t["index"] == record["best_index"])
    concurrency = best["best_concurrency"]

    port = servers.free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--config", str(tuned / "best.yaml"),
           "--port", str(port), "--log-level", "warning"]
    with servers.running(cmd, port) as url:
        summary = _load(url, tiny_llama, concurrency)
    assert summary["p99_ttft_ms"] <= TTFT_SLO_MS, summary
    assert summary["p99_itl_ms"] <= itl_slo_ms, summary


def test_the_config_file_plot_and_table_are_written(tuned, tiny_llama):
    import yaml

    config = yaml.safe_load((tuned / "best.yaml").read_text())
    assert config["model"] == str(tiny_llama)
    assert {"dtype", "kv-cache-memory"} <= set(config)  # the flags the tuner started from are kept
    assert (tuned / "trials.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the search's logic, on a known landscape ------------------------------------------------------

def _landscape_trial(slos: Slos, max_concurrency: int):
    """A model server: a step of a batch of b takes (20 + 4 b) ms, divided by the quantization's
    speed-up; a request is 16 tokens; clients beyond max-num-seqs wait for whole requests."""
    speed = {None: 1.0, "int8": 1.5, "int4": 2.0}

    def run(index: int, setting: Setting, start: int, reason: str) -> Trial:
        def measure(c: int) -> Level:
            batch = min(c, setting.max_num_seqs)
            step_ms = (20 + 4 * batch) / speed[setting.quantization]
            queue_ms = math.ceil(c / batch - 1) * 16 * step_ms
            summary = {"failed": 0, "completed": 2 * c, "request_throughput": batch / (16 * step_ms / 1e3),
                       "output_throughput": batch / step_ms * 1e3, "p99_ttft_ms": queue_ms + step_ms,
                       "p99_itl_ms": step_ms}
            return Level(c, summary, slos.misses(summary))

        return Trial(index, setting, search_load(measure, start, max_concurrency), seconds=1.0, reason=reason)

    return run


def test_the_search_finds_the_landscapes_best_setting_in_few_trials():
    slos = Slos(ttft_p99_ms=2000, itl_p99_ms=50, headroom=0.0)
    trials = []
    search = Search(Setting(), _landscape_trial(slos, 64), slos, Budget(trials=12),
                    knobs=("quantization", "max-num-seqs"), start_concurrency=4, max_concurrency=64, log=trials.append)
    best = search.run()
    # int4 halves the step: ITL (20 + 4 b) / 2 <= 50 up to b = 20; the grid would be 3 x 256 settings.
    assert best.setting.quantization == "int4"
    assert 16 < best.setting.max_num_seqs <= 20
    assert best.best.concurrency > best.setting.max_num_seqs  # the extra clients queue, within the TTFT SLO
    assert len(search.trials) <= 6
