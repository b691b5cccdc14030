"""Multi-turn chat through /v1/chat/completions: time to first token by turn, with the prefix cache
and without it, in one run.

    python -m benchmarks.multi_turn --base-url http://127.0.0.1:8000/v1 \\
        --cached smollm2 --uncached smollm2_nocache --out reports/multi_turn_smollm2

`--cached` and `--uncached` name two deployments of the same model, built alike but for
`--prefix-cache-entries` (benchmarks/multi_turn_smollm2.sh builds and serves them). A conversation
has `--turns` turns; each user message is a different piece of held-out standard-library source of
`--message-tokens` tokens ("What does this code do?"), each answer greedy, at most `--max-tokens`
tokens, and the next turn re-sends the whole conversation, as chat clients do: the history grows by
about message + answer tokens a turn. `--conversations` conversations run at once, one client each.

In each of `--rounds` rounds both deployments run the same conversations, one after the other (the
order alternates by round); each round has conversations of its own, so none reuses an earlier one's. Per request: TTFT = first chunk with text - request sent, the usage's
prompt_tokens and prompt_tokens_details.cached_tokens. The report gives, per turn, each deployment's
median TTFT (over conversations and rounds), the cached / uncached TTFT ratio (per round, median and
min-max across rounds: the claim), the cached tokens, and whether both deployments gave the same
answers (greedy: they must). Waits for an idle machine like benchmarks.compare (`--allow-busy` runs
anyway and marks the report NOT VALID). Writes results.json and report.md to `--out`.

`--soak-s S` runs the conversations against `--cached` alone, each over and over for S seconds, every
`--cancel-every`-th request closed at its first text (a client gone mid-answer), and writes soak.txt:
requests, answers, cancellations and failures, TTFT by turn.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

from client.api import API_KEY_ENV, median_and_spread, percentile
from dualend.engine.tokenizer import TextTokenizer
from dualend.train.data import stdlib_chunks

from .compare import (IDLE_LOAD, IDLE_WAIT_S, StreamedCompletion, aiohttp, completions_url, cut_prompts, environment,
                      error_message, settled_load)

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(base_url="http://127.0.0.1:8000/v1", conversations=4, turns=5, message_tokens=250, max_tokens=48,
                rounds=3, out=ROOT / "reports" / "multi_turn", tokenizer=ROOT / "build" / "checkpoints" / "smollm2",
                timeout_s=600.0, seed=11)
QUESTION = "What does this code do?\n\n"


async def turn_request(session, url: str, model: str, messages: list[dict], max_tokens: int,
                       cancel: bool = False) -> dict:
    """One streamed chat turn; `cancel` closes the stream at its first text (the client went away)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    completion = StreamedCompletion(time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return {"error": error_message(response.status, await response.text())}
            async for line in response.content:
                completion.feed(line.decode("utf-8"), time.perf_counter())
                if cancel and completion.chunk_times:
                    return {"cancelled": True, "ttft_s": completion.chunk_times[0] - completion.sent_at}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as failure:
        return {"error": f"{type(failure).__name__}: {failure}"}
    usage = completion.usage
    if completion.error or usage is None or not completion.chunk_times:
        return {"error": completion.error or "no text or no usage in the stream"}
    return {"ttft_s": completion.chunk_times[0] - completion.sent_at, "text": completion.text,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def run_conversations(url: str, model: str, headers: dict, messages_by_turn: list[list[str]],
                            max_tokens: int, timeout_s: float) -> list[list[dict]]:
    """Every conversation at once, each its turns in order; [conversation][turn] records."""
    async def conversation(user_messages: list[str]) -> list[dict]:
        history, records = [], []
        for message in user_messages:
            history.append({"role": "user", "content": message})
            record = await turn_request(session, url, model, history, max_tokens)
            records.append(record)
            if "error" in record:
                break
            history.append({"role": "assistant", "content": record["text"]})
        return records

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(conversation(messages) for messages in messages_by_turn))


async def soak(url: str, model: str, headers: dict, messages_by_turn: list[list[str]], max_tokens: int,
               seconds: float, cancel_every: int, timeout_s: float) -> list[dict]:
    """Every conversation in a loop for `seconds`, starting over after its last turn; every
    `cancel_every`-th request of a conversation is cancelled at its first text (and its turn dropped)."""
    deadline = time.perf_counter() + seconds

    async def conversation(index: int, user_messages: list[str]) -> list[dict]:
        records, sent = [], 0
        while time.perf_counter() < deadline:
            history = []
            for turn, message in enumerate(user_messages):
                if time.perf_counter() >= deadline:
                    break
                sent += 1
                cancel = cancel_every > 0 and (sent + index) % cancel_every == 0
                record = await turn_request(session, url, model, history + [{"role": "user", "content": message}],
                                            max_tokens, cancel)
                records.append(record | {"turn": turn + 1})
                if "error" in record:
                    break
                if not cancel:
                    history += [{"role": "user", "content": message}, {"role": "assistant", "content": record["text"]}]
        return records

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        found = await asyncio.gather(*(conversation(i, m) for i, m in enumerate(messages_by_turn)))
    return [record for records in found for record in records]


def soak_report(records: list[dict], seconds: float, conversations: int) -> str:
    answered = [r for r in records if "ttft_s" in r and not r.get("cancelled")]
    errors = [r["error"] for r in records if "error" in r]
    lines = [f"Multi-turn soak: {conversations} conversations for {seconds:.0f} s: {len(records)} requests, "
             f"{len(answered)} answered, {sum(bool(r.get('cancelled')) for r in records)} cancelled at their first "
             f"text, {len(errors)} failed" + (f" ({collections.Counter(errors).most_common(3)})" if errors else "")]
    for turn in sorted({r["turn"] for r in answered}):
        ttfts = sorted(r["ttft_s"] for r in answered if r["turn"] == turn)
        cached = statistics.median(r["cached_tokens"] for r in answered if r["turn"] == turn)
        lines.append(f"  turn {turn}: {len(ttfts)} answers, TTFT p50 {statistics.median(ttfts):.3f} s, "
                     f"p99 {percentile(ttfts, 99):.3f} s, cached tokens p50 {cached:.0f}")
    return "\n".join(lines) + "\n"


def summarize(rounds: list[dict], labels: tuple[str, str], turns: int) -> dict:
    """Per turn: each label's median TTFT and cached tokens, the cached/uncached ratio per round
    (median, min, max), and how many answers differ between the two."""
    cached, uncached = labels
    rows = []
    for turn in range(turns):
        def values(label, key, run):
            return [c[turn][key] for c in run[label] if len(c) > turn and "error" not in c[turn]]

        ratios = [statistics.median(values(cached, "ttft_s", run)) / statistics.median(values(uncached, "ttft_s", run))
                  for run in rounds if values(cached, "ttft_s", run) and values(uncached, "ttft_s", run)]
        differ = sum(a.get("text") != b.get("text") for run in rounds
                     for conv_a, conv_b in zip(run[cached], run[uncached]) if len(conv_a) > turn and len(conv_b) > turn
                     for a, b in [(conv_a[turn], conv_b[turn])])
        row = {"turn": turn + 1, "ratio": median_and_spread(ratios) if ratios else None, "answers_differ": differ}
        for label in labels:
            every = [v for run in rounds for v in values(label, "ttft_s", run)]
            row[label] = {"ttft_s": statistics.median(every) if every else None,
                          "prompt_tokens": statistics.median(v for run in rounds for v in values(label, "prompt_tokens", run)),
                          "cached_tokens": statistics.median(v for run in rounds for v in values(label, "cached_tokens", run))}
        rows.append(row)
    return {"turns": rows,
            "errors": {label: [r["error"] for run in rounds for c in run[label] for r in c if "error" in r]
                       for label in labels}}


def report(summary: dict, labels: tuple[str, str], settings: dict, valid: bool) -> str:
    cached, uncached = labels
    lines = ([] if valid else ["**NOT VALID: the machine was busy (--allow-busy)**", ""]) + [
        "# Multi-turn chat: TTFT by turn with and without the prefix cache", "",
        f"`{' '.join(settings['command'][2:])}`, {settings['started']}, load average at start "
        f"{settings['load_average_at_start'][0]:.2f}, commit {settings['git_commit'][:10]}"
        + (" (dirty)" if settings["git_dirty"] else ""), "",
        f"| turn | prompt tokens | cached tokens ({cached}) | TTFT {cached} (s) | TTFT {uncached} (s) | "
        f"ratio cached/uncached [min-max] | answers that differ |", "|---|---|---|---|---|---|---|"]
    for row in summary["turns"]:
        ratio = row["ratio"]
        ratio_text = "n/a" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}]"
        lines.append(f"| {row['turn']} | {row[uncached]['prompt_tokens']:.0f} | {row[cached]['cached_tokens']:.0f} | "
                     f"{row[cached]['ttft_s']:.3f} | {row[uncached]['ttft_s']:.3f} | {ratio_text} | "
                     f"{row['answers_differ']} |")
    errors = {label: len(found) for label, found in summary["errors"].items()}
    lines += ["", f"Failed requests: {errors}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=DEFAULTS["base_url"])
    parser.add_argument("--cached", required=True, help="the deployment with the prefix cache")
    parser.add_argument("--uncached", help="the same model built with --prefix-cache-entries 0")
    parser.add_argument("--api-key", default=None, help=f"default: ${API_KEY_ENV}")
    for key in ("conversations", "turns", "message_tokens", "max_tokens", "rounds", "seed"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=DEFAULTS[key])
    parser.add_argument("--timeout-s", type=float, default=DEFAULTS["timeout_s"])
    parser.add_argument("--tokenizer", type=Path, default=DEFAULTS["tokenizer"])
    parser.add_argument("--out", type=Path, default=DEFAULTS["out"])
    parser.add_argument("--allow-busy", action="store_true")
    parser.add_argument("--soak-s", type=float, default=0.0,
                        help="instead: the conversations against --cached in a loop for this long (--uncached unused)")
    parser.add_argument("--cancel-every", type=int, default=5, help="soak: every Nth request is cancelled")
    args = parser.parse_args(argv)
    if aiohttp is None:
        raise SystemExit("the HTTP client needs aiohttp: pip install -e '.[benchmark]'")
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tokenizer = TextTokenizer.from_json((args.tokenizer / "tokenizer.json").read_text(encoding="utf-8"))
    rounds_of_messages = 1 if args.soak_s else args.rounds  # each round new conversations: none reuses another's
    count = rounds_of_messages * args.conversations * args.turns
    pieces = iter(cut_prompts(tokenizer, stdlib_chunks("report", args.message_tokens * 6 + 64, args.seed),
                              args.message_tokens, count))
    by_round = [[[QUESTION + next(pieces) for _ in range(args.turns)] for _ in range(args.conversations)]
                for _ in range(rounds_of_messages)]
    messages = by_round[0]
    labels = (args.cached, args.uncached)
    url = completions_url(args.base_url, chat=True)
    if args.soak_s:
        records = asyncio.run(soak(url, args.cached, headers, messages, args.max_tokens, args.soak_s,
                                   args.cancel_every, args.timeout_s))
        text = soak_report(records, args.soak_s, args.conversations)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.txt").write_text(f"{' '.join(sys.argv)}\n{text}", encoding="utf-8")
        print(text)
        return {"records": records}
    if args.uncached is None:
        parser.error("--uncached is required (but with --soak-s)")
    load = settled_load(IDLE_LOAD, IDLE_WAIT_S)
    valid = load <= IDLE_LOAD
    if not valid and not args.allow_busy:
        raise SystemExit(f"the 1-minute load average is {load:.2f} (> {IDLE_LOAD}): stop what runs, or --allow-busy")
    settings = environment(argv, []) | {"command": [sys.executable, "-m", "benchmarks.multi_turn", *argv]}
    rounds = []
    for r in range(args.rounds):
        run = {}
        for label in (labels if r % 2 == 0 else labels[::-1]):
            run[label] = asyncio.run(run_conversations(url, label, headers, by_round[r], args.max_tokens,
                                                       args.timeout_s))
            print(f"round {r + 1}, {label}: turn TTFTs (s) of the first conversation "
                  f"{[round(t.get('ttft_s', float('nan')), 3) for t in run[label][0]]}", flush=True)
        rounds.append(run)
    summary = summarize(rounds, labels, args.turns)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary, "rounds": rounds},
                                                      indent=1), encoding="utf-8")
    text = report(summary, labels, settings, valid)
    (args.out / "report.md").write_text(text, encoding="utf-8")
    print(text)
    return summary


if __name__ == "__main__":
    main()
