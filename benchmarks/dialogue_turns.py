"""Per-turn cost of a conversation: sessions on the prefix cache vs the whole history every turn.

    python benchmarks/dialogue_turns.py                 # 3 runs of each, ~3 min on 2 cores
    python benchmarks/dialogue_turns.py --runs 1 --rounds 2   # one run each, the script twice (24 turns)

Replays examples/restaurant_booking.py's scripted conversation (12 turns: a booking, a
digression, back to the booking, questions, goodbye) on SmolLM2-135M-Instruct, two ways:

- session: each turn is one pagoda.lang program run on the session (`pagoda.dialogue`); the
  engine keeps the conversation's prefix pinned in its prefix cache, so a turn computes only its
  new tokens (incremental encoding);
- naive: the same program with the prefix cache off, so every prompt recomputes everything in
  it: the whole history each turn (the seed's failure case), and the NLU's few-shot prompts.

Records per turn the prompt tokens the engine computed (transcript and NLU) and the turn's
latency (median over the runs; every run starts a fresh engine, so no run reads another's
cache), and writes benchmarks/dialogue_turns.md, benchmarks/dialogue_turns.png and
benchmarks/results/dialogue-turns-DATE.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import restaurant_booking as app

from pagoda.platform import benchmark_cpu_flags, cpu_model


def run_once(model: str, naive: bool, script: list[str], reply_tokens: int) -> list[dict]:
    engine = app.engine(model, naive=naive, kv_cache_memory=0.25)
    dialogue = app.build(engine, reply_tokens)
    dialogue.prepare()
    session = dialogue.session()
    try:
        turns = [session.say(message) for message in script]
        return [{"turn": t.index, "user": t.user, "reply": t.reply, "intent": t.intent, "action": t.action,
                 "stack": t.stack, "history_tokens": t.transcript_tokens, "prompt_tokens": t.prompt_tokens,
                 "cached_tokens": t.cached_tokens, "computed_tokens": t.computed_tokens,
                 "computed_transcript": t.tokens("transcript"), "computed_nlu": t.tokens("nlu"),
                 "latency_s": t.latency_s} for t in turns]
    finally:
        session.close()
        dialogue.close()
        engine.llm.shutdown()


def merge(runs: list[list[dict]]) -> list[dict]:
    """The first run's turns, with the median latency over all runs."""
    merged = [dict(t) for t in runs[0]]
    for i, turn in enumerate(merged):
        turn["latency_s"] = statistics.median(r[i]["latency_s"] for r in runs)
        turn["latency_runs_s"] = [r[i]["latency_s"] for r in runs]
    return merged


def plot(session: list[dict], naive: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [t["turn"] for t in session]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(turns, [t["computed_tokens"] for t in naive], "o-", color="tab:red", label="naive: computed, total")
    ax1.plot(turns, [t["computed_transcript"] for t in naive], "o--", color="tab:red", alpha=0.5,
             label="naive: computed, transcript")
    ax1.plot(turns, [t["computed_tokens"] for t in session], "o-", color="tab:blue", label="session: computed, total")
    ax1.plot(turns, [t["computed_transcript"] for t in session], "o--", color="tab:blue", alpha=0.5,
             label="session: computed, transcript")
    ax1.plot(turns, [t["history_tokens"] for t in session], ":", color="gray", label="conversation length")
    ax1.set(xlabel="turn", ylabel="prompt tokens computed", title="Prompt tokens computed per turn")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(turns, [t["latency_s"] for t in naive], "o-", color="tab:red", label="naive (prefix cache off)")
    ax2.plot(turns, [t["latency_s"] for t in session], "o-", color="tab:blue", label="session (prefix cache, pinned)")
    ax2.set(xlabel="turn", ylabel="seconds", title="Turn latency (median of runs)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def decisions(turns: list[dict]) -> list[tuple]:
    return [(t["intent"], t["action"], t["stack"]) for t in turns]


def markdown(record: dict) -> str:
    s, n = record["session"], record["naive"]
    lines = [
        "# Dialogue turns: session vs naive history",
        "",
        f"`python benchmarks/dialogue_turns.py {' '.join(record['argv'])}`".replace(" `", "`"),
        f"({record['date']}; {record['model']}, quantization gguf; CPU: {record['cpu']}, "
        f"flags {' '.join(record['cpu_flags']) or 'none'}; latency is the median of {record['runs']} runs, each on a fresh engine).",
        "",
        "The scripted conversation of examples/restaurant_booking.py. *session*: each turn one pagoda.lang program",
        "run on the session (the engine keeps its prefix pinned in the prefix cache). *naive*: the same program with",
        "the prefix cache off, so each turn recomputes the whole history (and the NLU's few-shot prompts).",
        "Computed = prompt tokens the engine ran through the model (prompt minus cached), transcript + NLU.",
        "",
        "![per-turn computed tokens and latency](dialogue_turns.png)",
        "",
        "| turn | user | history tokens | computed, session (transcript + NLU) | computed, naive (transcript + NLU) "
        "| latency session, s | latency naive, s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for a, b in zip(s, n):
        lines.append(f"| {a['turn']} | {a['user']} | {a['history_tokens']} | {a['computed_tokens']} "
                     f"({a['computed_transcript']} + {a['computed_nlu']}) | {b['computed_tokens']} "
                     f"({b['computed_transcript']} + {b['computed_nlu']}) | {a['latency_s']:.2f} | {b['latency_s']:.2f} |")
    total = lambda turns, key: sum(t[key] for t in turns)
    lines += [
        f"| total | | | {total(s, 'computed_tokens')} | {total(n, 'computed_tokens')} | "
        f"{total(s, 'latency_s'):.2f} | {total(n, 'latency_s'):.2f} |",
        "",
        f"Same intents, actions and topic stacks in both: {'yes' if decisions(s) == decisions(n) else 'no'}; "
        f"same replies: {'yes' if [t['reply'] for t in s] == [t['reply'] for t in n] else 'no'} (greedy decoding, but a "
        "cached prefix and a recomputed one can differ in the last bits of the logits, enough to change a free answer).",
        "The machine is shared: each turn's latency in every run is in the JSON record (`latency_runs_s`).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="play the script this many times in one conversation")
    p.add_argument("--reply-tokens", type=int, default=40)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("--from-json", type=Path, help="only redraw the plot and table from a JSON record")
    args = p.parse_args()
    if args.from_json:
        record = json.loads(args.from_json.read_text())
        plot(record["session"], record["naive"], args.out / "dialogue_turns.png")
        (args.out / "dialogue_turns.md").write_text(markdown(record))
        return
    script = app.SCRIPT * args.rounds
    runs: dict[str, list] = {"session": [], "naive": []}
    for i in range(args.runs):
        for mode in ("session", "naive"):  # interleaved, so the machine's noise falls on both
            runs[mode].append(run_once(args.model, mode == "naive", script, args.reply_tokens))
            print(f"run {i + 1}/{args.runs} {mode}: computed per turn "
                  f"{[t['computed_tokens'] for t in runs[mode][-1]]}", flush=True)
    record = {"date": date.today().isoformat(), "argv": sys.argv[1:], "model": args.model, "runs": args.runs,
              "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
              "session": merge(runs["session"]), "naive": merge(runs["naive"])}
    out = args.out
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / f"dialogue-turns-{record['date']}.json").write_text(json.dumps(record, indent=1))
    plot(record["session"], record["naive"], out / "dialogue_turns.png")
    (out / "dialogue_turns.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
