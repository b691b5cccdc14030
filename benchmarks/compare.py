"""One benchmark, one run, interleaved: serving stacks on the same model, measured by one client.

    python -m benchmarks.compare --openai smollm2=http://127.0.0.1:8000/v1@smollm2 --llama-server --ortgenai \\
        --in-process engine=build/export/smollm2_w8a8 --reference smollm2
    python -m benchmarks.compare --openai smollm2=http://127.0.0.1:8000/v1@smollm2 --smoke

Workloads: held-out standard-library source cut to exact SmolLM2 token counts, or held-out chat requests
(`chat`), a different prompt for every request; greedy, EOS ignored, so every request generates its
max_tokens.
  prompt-heavy   700-token prompts, 128 output tokens
  decode-heavy    60-token prompts, 256 output tokens
  ttft-2048    2040-token prompts,   8 output tokens: 2048 in all, smollm2's raw_context_limit (it refuses
               a 2048-token prompt with any max_tokens); TTFT only
  chat         held-out open-ended requests (dualend.train.open_prompts: explain, describe, advise, write;
               topics no draft head trained on) under the chat template, sent as raw completions,
               256 output tokens (EOS ignored as everywhere: an answer that ends sooner goes on past its
               end, as the model writes it): what verified drafts give on answers users ask for
A cell is (workload, concurrency N): N closed-loop clients each send one warm-up request (not counted)
and, once all have answered, `--requests` requests one after another. Per request, over streamed
/v1/completions: TTFT = first chunk with text - request sent; TPOT = (last chunk with text - first) /
(completion_tokens - 1), completion_tokens from the usage chunk (a dual-end chunk may carry 2 tokens),
or from re-tokenizing the text where a server sends no usage (the report says so). Per cell: output
tokens/s = completion tokens of the requests that succeeded / wall time from the end of the warm-up to
the last answer; TTFT and TPOT p50 (median) and p99 (nearest rank) over its requests; errors by message.

In each of `--rounds` rounds every cell runs for every target, the target order rotated each round.
The report gives each figure's median across rounds and each target's ratio to `--reference`
(target / reference, computed per round; median and min-max across rounds): the ratios are the claims.

Targets:
  --openai LABEL=BASE_URL@MODEL  an OpenAI-compatible server (repeatable); `--api-key`, default
      $DUALEND_API_KEY, goes as a Bearer token. Through the gateway at concurrency 16 or more use a key
      with a larger max_requests than the default 16 (docs/operations.md): a client's next request may
      arrive before its last one is released.
  --llama-server  llama.cpp's server, started by benchmarks.peers with one 2048-token slot per client
      at the highest concurrency, sent `cache_prompt: false` (no prompt cache, as ours).
  --ortgenai  onnxruntime-genai in-process and batch-synchronous, not a server: at concurrency N,
      batches of N prompts, one generate call each.
  --in-process LABEL=EXPORT_DIR[@synthetic=RATE][@threshold=T]  our decode loop in-process, batch =
      concurrency, output tokens/s only: the ceiling of our serving path.
Before the first cell the run waits (up to --idle-wait-s) for the 1-minute load average to fall to
IDLE_LOAD (0.5), and refuses to run on a busier machine; `--allow-busy` runs anyway and the report
opens with NOT VALID.
Writes results.json (every request, cell summaries, environment), report.md and plots to `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from tqdm import tqdm

try:
    import aiohttp
except ImportError:  # the `benchmark` extra: pip install -e '.[benchmark]'
    aiohttp = None

from client.api import API_KEY_ENV, median_and_spread, percentile
from dualend.engine.tokenizer import TextTokenizer
from dualend.train.data import stdlib_chunks
from dualend.train.open_prompts import open_prompts

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(concurrency=[1, 4, 16], requests=3, rounds=3, out=ROOT / "reports" / "compare",
                tokenizer=ROOT / "build" / "checkpoints" / "smollm2", llama_port=8090, threads=2, timeout_s=600.0,
                seed=7)
SMOKE_OUTPUT_TOKENS = 16
LLAMA_SLOT_CONTEXT = 2048  # smollm2's raw_context_limit: what each of llama-server's slots holds
PEERS_HINT = "the peer engines are not installed: run `bash scripts/install_peers.sh`"
NAN = float("nan")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int  # 0: held-out chat requests, each as long as it is
    output_tokens: int
    figures: tuple[str, ...] = ("tokens_per_s", "ttft", "tpot")

    def describe(self, output_tokens: int) -> str:
        prompts = (f"{self.prompt_tokens}-token prompts" if self.prompt_tokens
                   else "held-out open-ended chat requests under the chat template")
        return f"{prompts}, {output_tokens} output tokens"


# A run counts as measured on an idle machine when the 1-minute load average, before the first cell,
# is at most IDLE_LOAD: a busy machine slows the targets unequally (docs/benchmarks.md#smollm2-against-its-peers).
# A starting server leaves load behind, so the run waits up to IDLE_WAIT_S for it to settle.
IDLE_LOAD, IDLE_WAIT_S = 0.5, 300.0

WORKLOADS = {"prompt-heavy": Workload(700, 128), "decode-heavy": Workload(60, 256),
             "ttft-2048": Workload(2040, 8, ("ttft",)), "chat": Workload(0, 256)}


# --- prompts -------------------------------------------------------------------------------------

def cut_prompts(tokenizer: TextTokenizer, texts: Iterable[str], length: int, count: int) -> list[str]:
    """`count` prompts of exactly `length` tokens as served (BOS included where the tokenizer adds one):
    each text's first tokens decoded, kept where the text encodes back to `length` tokens (and once)."""
    body = length - (1 if tokenizer.add_bos else 0)
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) < body:
            continue
        prompt = tokenizer.decode(ids[:body])
        if tokenizer.prompt_length(prompt) == length and prompt not in prompts:
            prompts.append(prompt)
            if len(prompts) == count:
                return prompts
    raise ValueError(f"only {len(prompts)} of {count} texts give a {length}-token prompt")


def chat_requests(tokenizer: TextTokenizer, count: int, seed: int) -> list[str]:
    """`count` held-out open-ended requests (topics no draft head trained on) rendered under the chat
    template, sent as raw completions so that every server sees the same text."""
    requests = open_prompts("held_out", seed + 1)  # another order than the records' held-out shard (seed 0)
    if count > len(requests):
        raise ValueError(f"the chat workload has {len(requests)} held-out requests; this run needs {count}")
    return [tokenizer.user_turn(q) for q in requests[:count]]


def plan_prompts(pool: list[str], concurrencies: list[int], requests: int, rounds: int) -> dict:
    """{(round, concurrency): each client's prompts, warm-up first}: every prompt of a workload is used
    by one cell only (no prefix-cache hits across cells), and by every target in that cell."""
    plan, start = {}, 0
    for r in range(rounds):
        for c in concurrencies:
            plan[(r, c)] = [pool[start + i * (requests + 1): start + (i + 1) * (requests + 1)] for i in range(c)]
            start += c * (requests + 1)
    return plan


def pool_size(concurrencies: list[int], requests: int, rounds: int) -> int:
    return rounds * sum(concurrencies) * (requests + 1)


# --- one streamed request -----------------------------------------------------------------------

class StreamedCompletion:
    """A /v1/completions SSE stream read line by line: text chunk times, usage, [DONE] or an error."""

    def __init__(self, sent_at: float):
        self.sent_at, self.text, self.chunk_times = sent_at, "", []
        self.usage_tokens: int | None = None
        self.usage: dict | None = None  # the usage chunk's object, whole
        self.error: str | None = None
        self.error_code: str | None = None  # OpenAI's `code` of an error event
        self.done = False

    def feed(self, line: str, now: float) -> None:
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, comments, "event:" lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return
        payload = json.loads(data)
        if "error" in payload:
            self.error, self.error_code = error_fields(payload["error"])
            return
        if payload.get("usage"):
            self.usage = payload["usage"]
            self.usage_tokens = self.usage["completion_tokens"]
        for choice in payload.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                self.text += text
                self.chunk_times.append(now)

    def record(self, tokenizer: TextTokenizer) -> dict:
        if self.error is None and not self.done:
            self.error = "the stream ended without data: [DONE]"
        counted = self.usage_tokens is None
        tokens = len(tokenizer.encode(self.text)) if counted else self.usage_tokens
        times = self.chunk_times
        return {"ttft_s": times[0] - self.sent_at if times else NAN,
                "tpot_s": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else NAN,
                "completion_tokens": tokens, "chunks": len(times),
                "tokens_from": "re-tokenized text" if counted else "usage", "error": self.error}


def error_fields(error) -> tuple[str, str | None]:
    """(message, code) of an OpenAI error object, or of whatever else a server sent as its error."""
    if isinstance(error, dict):
        return str(error.get("message", error)), error.get("code")
    return str(error), None


def error_message(status: int, body: str) -> str:
    """An HTTP error answer as `HTTP <status> [<OpenAI error code>]: <message>`."""
    try:
        message, code = error_fields(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200]}"
    return f"HTTP {status}{f' {code}' if code else ''}: {message}"


def completions_url(base_url: str, chat: bool = False) -> str:
    base = base_url.rstrip("/")
    return (base if base.endswith("/v1") else base + "/v1") + ("/chat/completions" if chat else "/completions")


# --- targets: run_cell(clients' prompts, max_tokens) -> (records, measured wall seconds) ------------

class OpenAITarget:
    measures_latency = True

    def __init__(self, label: str, base_url: str, model: str, api_key: str | None, tokenizer: TextTokenizer,
                 timeout_s: float, extra_body: dict | None = None, **settings):
        if aiohttp is None:
            raise SystemExit("the HTTP client needs aiohttp: pip install -e '.[benchmark]'")
        self.label, self.url, self.model, self.tokenizer = label, completions_url(base_url), model, tokenizer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.extra_body = timeout_s, extra_body or {}
        self.settings = {"kind": "OpenAI-compatible server, streamed /v1/completions", "url": self.url,
                         "model": model, "api_key": bool(api_key), "extra_body": self.extra_body, **settings}

    def run_cell(self, clients: list[list[str]], max_tokens: int) -> tuple[list[dict], float]:
        return asyncio.run(self._cell(clients, max_tokens))

    async def _cell(self, clients: list[list[str]], max_tokens: int) -> tuple[list[dict], float]:
        async def client(prompts: list[str]) -> list[dict]:
            return [await self.request(session, prompt, max_tokens) for prompt in prompts]

        async with aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(limit=len(clients)),
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            await asyncio.gather(*(self.request(session, prompts[0], max_tokens) for prompts in clients))
            started = time.perf_counter()
            answers = await asyncio.gather(*(client(prompts[1:]) for prompts in clients))
            wall = time.perf_counter() - started
        return [record | {"client": i} for i, records in enumerate(answers) for record in records], wall

    async def request(self, session, prompt: str, max_tokens: int, retry_stale: bool = True) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, **self.extra_body}
        completion = StreamedCompletion(time.perf_counter())
        try:
            async with session.post(self.url, json=body) as response:
                if response.status != 200:
                    completion.error = error_message(response.status, await response.text())
                else:
                    async for line in response.content:
                        completion.feed(line.decode("utf-8"), time.perf_counter())
        except aiohttp.ServerDisconnectedError as error:
            # A kept-alive connection the server closed meanwhile (llama-server closes them between a
            # cell's warm-up and its requests): sent again once on a new connection, timed from then.
            if retry_stale and not completion.chunk_times and not completion.text:
                return await self.request(session, prompt, max_tokens, retry_stale=False)
            completion.error = f"{type(error).__name__}: {error}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:  # ValueError: a chunk not JSON
            completion.error = f"{type(error).__name__}: {error}"
        return completion.record(self.tokenizer)


def import_peers():
    try:
        from benchmarks import peers
    except ImportError as error:
        raise SystemExit(f"{PEERS_HINT} ({error})") from error
    return peers


def peer_missing(flag: str, error: Exception) -> SystemExit:
    message = f"{flag}: {error}"
    return SystemExit(message if "install_peers.sh" in message else f"{message}; {PEERS_HINT}")


def llama_server_target(stack: contextlib.ExitStack, port: int, parallel: int, tokenizer: TextTokenizer,
                        timeout_s: float) -> OpenAITarget:
    """llama.cpp's server with `parallel` slots of LLAMA_SLOT_CONTEXT tokens each; no prompt cache, as ours."""
    peers = import_peers()
    context = parallel * LLAMA_SLOT_CONTEXT
    try:
        base_url = stack.enter_context(peers.llama_server(port=port, parallel=parallel, context=context))
        command = peers.llama_server_command(port, parallel=parallel, context=context)
    except (ImportError, FileNotFoundError) as error:
        raise peer_missing("--llama-server", error) from error
    return OpenAITarget("llama-server", base_url, "smollm2", None, tokenizer, timeout_s,
                        extra_body={"cache_prompt": False}, command=command)


def token_stamps_record(stamps: list[float]) -> dict:
    """A request of an in-process batch from its token times (seconds since the call)."""
    n = len(stamps)
    return {"ttft_s": stamps[0] if n else NAN, "tpot_s": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else NAN,
            "completion_tokens": n, "tokens_from": "token timestamps", "error": None}


class OrtGenAITarget:
    label, measures_latency = "ortgenai", True

    def __init__(self, tokenizer: TextTokenizer):
        peers = import_peers()
        try:
            self.engine = peers.OrtGenAI()
        except (ImportError, FileNotFoundError) as error:
            raise peer_missing("--ortgenai", error) from error
        self.tokenizer = tokenizer
        self.settings = {"kind": "onnxruntime-genai in-process, batch-synchronous (not a server): at concurrency N, "
                                 "batches of N prompts, one generate call each",
                         "model": str(getattr(peers, "ORTGENAI_MODEL", "?"))}

    def run_cell(self, clients: list[list[str]], max_tokens: int) -> tuple[list[dict], float]:
        batches = [[self.tokenizer.encode_prompt(prompts[j]) for prompts in clients] for j in range(len(clients[0]))]
        self.engine.generate(batches[0], max_tokens)  # warm-up
        records, wall = [], 0.0
        for batch in batches[1:]:
            started = time.perf_counter()
            try:
                records += [token_stamps_record(stamps) for stamps in self.engine.generate(batch, max_tokens)]
            except Exception as error:  # a peer's failure is a figure of the run, counted by message
                records += [{"completion_tokens": 0, "error": f"{type(error).__name__}: {error}"}] * len(batch)
            wall += time.perf_counter() - started
        return records, wall


class InProcessTarget:
    """Our decode loop in-process (benchmarks.bench_engine.batched_throughput): output tokens/s only."""
    measures_latency = False

    def __init__(self, label: str, directory: Path, synthetic: float | None, threshold: float | None, threads: int):
        from dualend.engine.onnx_engine import OnnxComponents
        self.label, self.synthetic = label, synthetic
        self.components = OnnxComponents(directory, threads=threads)
        if threshold is None and self.components.pair_size == 2:
            raise SystemExit(f"--in-process {label}: a dual-end export needs @threshold=T (the deployment's "
                             f"acceptance_threshold, in its config.pbtxt)")
        self.threshold = 1.0 if threshold is None else threshold
        self.settings = {"kind": "our decode loop in-process (batched_throughput), batch = concurrency, "
                                 "one prompt per batch", "export": str(directory), "threads": threads,
                         "acceptance_threshold": self.threshold, "synthetic_acceptance": synthetic}

    def run_cell(self, clients: list[list[str]], max_tokens: int) -> tuple[list[dict], float]:
        from benchmarks.bench_engine import batched_throughput
        from dualend.engine.decode import SamplingParams
        params, batch = SamplingParams(max_tokens=max_tokens, ignore_eos=True), len(clients)
        tokenizer = self.components.exported.tokenizer()
        prompts = [tokenizer.encode_prompt(text) for text in clients[0]]
        batched_throughput(self.components, prompts[0], params, self.threshold, batch, self.synthetic)  # warm-up
        records, wall = [], 0.0
        for prompt in prompts[1:]:
            rate = batched_throughput(self.components, prompt, params, self.threshold, batch, self.synthetic)
            tokens = batch * max_tokens  # EOS ignored: every request decodes max_tokens
            records.append({"batch": batch, "completion_tokens": tokens, "tokens_per_s": rate, "ttft_s": NAN,
                            "tpot_s": NAN, "tokens_from": "max_tokens x batch", "error": None})
            wall += tokens / rate
        return records, wall


# --- figures ----------------------------------------------------------------------------------------

def summarize(records: list[dict], wall_s: float) -> dict:
    """A cell's figures: tokens/s over its wall time; TTFT, TPOT p50 and p99 of the requests that succeeded."""
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["completion_tokens"] for r in ok)
    ttft, tpot = [r.get("ttft_s", NAN) for r in ok], [r.get("tpot_s", NAN) for r in ok]
    return {"requests": sum(r.get("batch", 1) for r in records), "errors": len(records) - len(ok),
            "error_messages": dict(collections.Counter(r["error"] for r in records if r["error"] is not None)),
            "output_tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else NAN,
            "ttft_p50_s": median_and_spread(ttft)[0], "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": median_and_spread(tpot)[0], "tpot_p99_s": percentile(tpot, 0.99),
            "tokens_from": sorted({r["tokens_from"] for r in ok})}


def across_rounds(cells: list[dict], metric: str) -> dict[tuple, float]:
    """{(target, workload, concurrency): the metric's median across rounds}."""
    values = collections.defaultdict(list)
    for cell in cells:
        values[(cell["target"], cell["workload"], cell["concurrency"])].append(cell["summary"][metric])
    return {key: median_and_spread(v)[0] for key, v in values.items()}


def ratios(cells: list[dict], reference: str, metric: str) -> dict[tuple, tuple[float, float, float]]:
    """{(target, workload, concurrency): (median, min, max) across rounds of target / reference, each
    ratio taken within one round}."""
    by_cell = {(c["round"], c["workload"], c["concurrency"], c["target"]): c["summary"][metric] for c in cells}
    per_round = collections.defaultdict(list)
    for (r, workload, concurrency, target), value in by_cell.items():
        base = by_cell.get((r, workload, concurrency, reference), NAN)
        if base > 0 and not math.isnan(value):
            per_round[(target, workload, concurrency)].append(value / base)
    return {key: (statistics.median(v), min(v), max(v)) for key, v in per_round.items()}


def rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


# --- report ---------------------------------------------------------------------------------------

FIGURE_TABLES = {"tokens_per_s": ("output tokens/s", ("tokens_per_s",), 1.0),
                 "ttft": ("TTFT ms, p50 / p99", ("ttft_p50_s", "ttft_p99_s"), 1e3),
                 "tpot": ("TPOT ms, p50 / p99", ("tpot_p50_s", "tpot_p99_s"), 1e3)}


def number(value: float, scale: float) -> str:
    return "-" if math.isnan(value) else f"{value * scale:.1f}"


def figure_table(cells: list[dict], name: str, figure: str, targets: list[str], concurrencies: list[int],
                 reference: str | None) -> list[str]:
    title, metrics, scale = FIGURE_TABLES[figure]
    medians = [across_rounds(cells, m) for m in metrics]
    ratio = ratios(cells, reference, metrics[0]) if reference else {}
    lines = [f"{title}\n", "| target | " + " | ".join(f"c{c}" for c in concurrencies) + " |",
             "|---" * (len(concurrencies) + 1) + "|"]
    for target in targets:
        row = []
        for c in concurrencies:
            key = (target, name, c)
            row.append(" / ".join(number(m.get(key, NAN), scale) for m in medians))
            if key in ratio and target != reference:
                row[-1] += " x{:.2f} [{:.2f}-{:.2f}]".format(*ratio[key])
        lines.append(f"| {target} | " + " | ".join(row) + " |")
    return lines + [""]


def report_tables(cells: list[dict], targets: list[str], concurrencies: list[int], workloads: list[str],
                  reference: str | None) -> str:
    lines = []
    for name in workloads:
        workload, mine = WORKLOADS[name], [c for c in cells if c["workload"] == name]
        output_tokens = "/".join(str(n) for n in sorted({c["max_tokens"] for c in mine})) or workload.output_tokens
        lines.append(f"\n### {name}: {workload.describe(output_tokens)}\n")
        for figure in workload.figures:
            lines += figure_table(mine, name, figure, targets, concurrencies, reference)
        errors = collections.Counter()
        for cell in mine:
            for message, count in cell["summary"]["error_messages"].items():
                errors[(cell["target"], cell["concurrency"], message)] += count
        lines.append("Errors:" + ("" if errors else " none"))
        lines += [f"- {target} c{c}: {count} x {message}" for (target, c, message), count in errors.items()]
        recounted = sorted({c["target"] for c in mine if "re-tokenized text" in c["summary"]["tokens_from"]})
        if recounted:
            lines.append(f"\nNo usage from {', '.join(recounted)}: completion tokens counted by re-tokenizing "
                         f"the text.")
    return "\n".join(lines)


def plots(cells: list[dict], targets: list[str], concurrencies: list[int], workloads: list[str],
          out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for figure, metric, ylabel, filename in (("tokens_per_s", "tokens_per_s", "output tokens/s", "throughput.png"),
                                             ("tpot", "tpot_p50_s", "TPOT p50, ms", "tpot.png")):
        names = [w for w in workloads if figure in WORKLOADS[w].figures]
        if not names:
            continue
        medians, scale = across_rounds(cells, metric), 1.0 if figure == "tokens_per_s" else 1e3
        fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
        for ax, name in zip(axes[0], names):
            for target in targets:
                points = [(c, medians.get((target, name, c), NAN) * scale) for c in concurrencies]
                points = [(c, v) for c, v in points if not math.isnan(v)]
                if points:
                    ax.plot(*zip(*points), marker="o", label=target)
            ax.set_xscale("log", base=2)
            ax.set(title=name, xlabel="concurrency", ylabel=ylabel, ylim=(0, None))
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies], minor=False)
            ax.minorticks_off()
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)
        written.append(filename)
    if "ttft-2048" in workloads:
        medians = across_rounds(cells, "ttft_p50_s")
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(concurrencies)
        for i, c in enumerate(concurrencies):
            ax.bar([t + i * width for t in range(len(targets))],
                   [medians.get((target, "ttft-2048", c), NAN) * 1e3 for target in targets], width, label=f"c{c}")
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(targets))], targets)
        ax.set(title=f"TTFT, {WORKLOADS['ttft-2048'].prompt_tokens}-token prompts", ylabel="TTFT p50, ms")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft_2048.png")
        plt.close(fig)
        written.append("ttft_2048.png")
    return written


def settled_load(max_load: float, wait_s: float, load=lambda: os.getloadavg()[0], clock=time.monotonic,
                 sleep=time.sleep, poll_s: float = 5.0) -> float:
    """The 1-minute load average once it is at most `max_load`, or its last reading after `wait_s`."""
    deadline = clock() + wait_s
    reading = load()
    while reading > max_load and clock() < deadline:
        sleep(poll_s)
        reading = load()
    return reading


def environment(argv: list[str], targets: list) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_at_start": os.getloadavg(),
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
            "command": [sys.executable, "-m", "benchmarks.compare", *argv], "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "targets": {t.label: t.settings for t in targets}}


def without_nan(value):
    """JSON has no NaN: a figure that does not exist is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nan(v) for v in value]
    return value


# --- command line -----------------------------------------------------------------------------------

def parse_openai(spec: str) -> tuple[str, str, str]:
    """LABEL=BASE_URL@MODEL -> (label, base_url, model)."""
    label, _, rest = spec.partition("=")
    base_url, _, model = rest.rpartition("@")
    if not (label and base_url and model):
        raise argparse.ArgumentTypeError(f"--openai takes LABEL=BASE_URL@MODEL, got {spec!r}")
    return label, base_url, model


def parse_in_process(spec: str) -> tuple[str, Path, dict[str, float]]:
    """LABEL=EXPORT_DIR[@synthetic=RATE][@threshold=T] -> (label, directory, options)."""
    label, _, rest = spec.partition("=")
    directory, *options = rest.split("@")
    parsed = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("synthetic", "threshold") or not value:
            raise argparse.ArgumentTypeError(f"--in-process option {option!r}: synthetic=RATE or threshold=T")
        parsed[key] = float(value)
    if not (label and directory):
        raise argparse.ArgumentTypeError(f"--in-process takes LABEL=EXPORT_DIR[@synthetic=RATE], got {spec!r}")
    return label, Path(directory), parsed


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openai", type=parse_openai, action="append", default=[], metavar="LABEL=BASE_URL@MODEL")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    parser.add_argument("--llama-server", action="store_true", help="start llama.cpp's server (benchmarks.peers)")
    parser.add_argument("--llama-port", type=int, default=DEFAULTS["llama_port"])
    parser.add_argument("--ortgenai", action="store_true", help="onnxruntime-genai in-process (benchmarks.peers)")
    parser.add_argument("--in-process", type=parse_in_process, action="append", default=[],
                        metavar="LABEL=EXPORT_DIR[@synthetic=RATE][@threshold=T]")
    parser.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="in-process engine threads")
    parser.add_argument("--reference", default=None, help="the target the ratios are taken against")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=["prompt-heavy", "decode-heavy", "ttft-2048"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=DEFAULTS["concurrency"])
    parser.add_argument("--requests", type=int, default=DEFAULTS["requests"], help="measured requests per client")
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--tokenizer", type=Path, default=DEFAULTS["tokenizer"], help="folder of tokenizer.json")
    parser.add_argument("--timeout-s", type=float, default=DEFAULTS["timeout_s"], help="per request")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--out", type=Path, default=DEFAULTS["out"])
    parser.add_argument("--allow-busy", action="store_true",
                        help=f"run even if the load average stays above {IDLE_LOAD}; the report says NOT VALID")
    parser.add_argument("--idle-wait-s", type=float, default=IDLE_WAIT_S,
                        help="how long to wait for the load average to settle (default %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"check the wiring: 1 round, 1 request per client, concurrency 1, "
                             f"at most {SMOKE_OUTPUT_TOKENS} output tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.requests, args.concurrency = 1, 1, [1]
    labels = [o[0] for o in args.openai] + [i[0] for i in args.in_process] + \
        ["llama-server"] * args.llama_server + ["ortgenai"] * args.ortgenai
    if not labels:
        parser.error("no target: give --openai, --llama-server, --ortgenai or --in-process")
    if len(set(labels)) < len(labels):
        parser.error(f"target labels must differ, got {labels}")
    if args.reference is not None and args.reference not in labels:
        parser.error(f"--reference {args.reference} is not a target ({labels})")
    tokenizer = TextTokenizer.from_json((args.tokenizer / "tokenizer.json").read_text(encoding="utf-8"),
                                        config.read_text(encoding="utf-8")
                                        if (config := args.tokenizer / "tokenizer_config.json").exists() else None)

    with contextlib.ExitStack() as stack:
        targets = [OpenAITarget(label, url, model, args.api_key, tokenizer, args.timeout_s)
                   for label, url, model in args.openai]
        targets += [InProcessTarget(label, directory, options.get("synthetic"), options.get("threshold"), args.threads)
                    for label, directory, options in args.in_process]
        if args.llama_server:
            targets.append(llama_server_target(stack, args.llama_port, max(args.concurrency), tokenizer,
                                               args.timeout_s))
        if args.ortgenai:
            targets.append(OrtGenAITarget(tokenizer))
        env = environment(argv, targets)
        prompts = {}
        for name in tqdm(args.workloads, desc="prompts"):
            length, size = WORKLOADS[name].prompt_tokens, pool_size(args.concurrency, args.requests, args.rounds)
            pool = (cut_prompts(tokenizer, stdlib_chunks("report", length * 6 + 64, args.seed), length, size) if length
                    else chat_requests(tokenizer, size, args.seed))
            prompts[name] = plan_prompts(pool, args.concurrency, args.requests, args.rounds)
        env["load_average_before_cells"] = settled_load(IDLE_LOAD, args.idle_wait_s)
        env["idle"] = env["load_average_before_cells"] <= IDLE_LOAD
        if not env["idle"] and not args.allow_busy:
            raise SystemExit(f"the 1-minute load average is {env['load_average_before_cells']:.2f} on "
                             f"{os.cpu_count()} cores after waiting {args.idle_wait_s:.0f} s (idle is <= {IDLE_LOAD}): "
                             "another job would slow the targets unequally; stop it, or pass --allow-busy "
                             "(the report then says the run is not valid)")
        cells = []
        plan = [(r, w, c) for r in range(args.rounds) for w in args.workloads for c in args.concurrency]
        for r, name, c in tqdm(plan, desc="cells"):
            workload = WORKLOADS[name]
            max_tokens = min(workload.output_tokens, SMOKE_OUTPUT_TOKENS) if args.smoke else workload.output_tokens
            for target in rotated(targets, r):
                if workload.figures == ("ttft",) and not target.measures_latency:
                    continue
                records, wall = target.run_cell(prompts[name][(r, c)], max_tokens)
                cells.append({"round": r, "workload": name, "concurrency": c, "target": target.label,
                              "max_tokens": max_tokens, "summary": summarize(records, wall), "requests": records})
                args.out.mkdir(parents=True, exist_ok=True)  # kept as it goes: a stopped run keeps its cells
                (args.out / "cells.partial.json").write_text(json.dumps(without_nan(cells)))
    env["load_average_at_end"] = os.getloadavg()

    order = [t.label for t in targets]
    tables = report_tables(cells, order, args.concurrency, args.workloads, args.reference)
    args.out.mkdir(parents=True, exist_ok=True)
    written = plots(cells, order, args.concurrency, args.workloads, args.out)
    busy = "" if env["idle"] else (
        f"**NOT VALID: the machine was busy** (1-minute load average {env['load_average_before_cells']:.2f} "
        f"before the first cell, idle is <= {IDLE_LOAD}; it ran with --allow-busy).\n\n")
    header = (f"# Serving comparison, one client, interleaved\n\n{busy}{env['started']}; {env['cpu']}, {env['cores']} "
              f"cores, load average {env['load_average_at_start'][0]:.2f} at start, "
              f"{env['load_average_before_cells']:.2f} before the first cell; commit {env['git_commit'][:12]}"
              f"{' (dirty)' if env['git_dirty'] else ''}\n\n`{' '.join(env['command'])}`\n\n{args.rounds} rounds, "
              f"{args.requests} requests per client after 1 warm-up each; greedy, EOS ignored"
              f"{'; SMOKE RUN' if args.smoke else ''}. Each figure is the median across rounds"
              + (f"; x = target / {args.reference}, median [min-max] of the ratios taken within each round "
                 f"(for TTFT and TPOT, of p50)" if args.reference else "") + ".\n\nTargets:\n"
              + "".join(f"- {t.label}: {t.settings['kind']}\n" for t in targets))
    (args.out / "report.md").write_text(header + tables + "\n\n" + "".join(f"![{p}]({p})\n" for p in written))
    results = {"environment": env, "rounds": args.rounds, "requests_per_client": args.requests,
               "concurrency": args.concurrency, "workloads": {w: asdict(WORKLOADS[w]) for w in args.workloads},
               "reference": args.reference, "cells": cells}
    (args.out / "results.json").write_text(json.dumps(without_nan(results), indent=1))
    (args.out / "cells.partial.json").unlink(missing_ok=True)
    print(tables)
    print(f"\nwrote {args.out / 'report.md'}, {args.out / 'results.json'}, {', '.join(written)}")
    return results


if __name__ == "__main__":
    main()
