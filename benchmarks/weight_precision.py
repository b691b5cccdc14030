"""Weight precision of the backbone: the NLL cost and the size of int8, int4 and w8a8 exports against fp32.

    nice -n 10 python -m benchmarks.weight_precision --checkpoint build/checkpoints/smollm2 --chunks 8 --tokens 256
    python -m benchmarks.weight_precision --timing      # also the per-step decode time, batch 1 and 16

Exports the checkpoint at each precision (`builder.export`, reused when it matches) to
<export-dir>/<checkpoint>-<precision>, then teacher-forces held-out text (standard-library source of the
evaluation's "report" split, BOS first) through each export's backbone on ONNX Runtime, one batched
decode step per latent, all chunks together. Reports the mean NLL of the tokens the backbone predicts
(for a dual-end model, the first token after each pair; the MTP head's drafts are not scored), its
change from fp32, how often the top token equals fp32's, the quantized nodes and the file sizes.
`--timing` then times decode steps of all precisions, taking turns, after `--timing-context` latents.
`--task-check` also asks each export the conversion gate's short chat questions
(builder/data/chat_questions.json, under the chat template, greedy, `--task-tokens` at most): how many it
answers right, and how many of its answers are fp32's word for word. `--first-tokens QUESTION` prints each
export's five likeliest first tokens of the answer to QUESTION (under the chat template), with their
log-probabilities: how near a tie the quantized weights may flip.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

from builder.evaluate_conversion import DEFAULTS as GATE_DEFAULTS, answered_right, task_questions
from builder.export import WEIGHT_BITS, export_checkpoint, export_matches
from builder.quantize import constant_weight_matmuls
from client.api import median_and_spread
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.manifest import ManifestError
from dualend.engine.onnx_engine import ExportedModel, OnnxComponents
from dualend.serving.offline import generate_text
from dualend.train.data import stdlib_chunks

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(checkpoint=ROOT / "build" / "checkpoints" / "smollm2",
                export_dir=ROOT / "build" / "export" / "weight_precision", precisions=list(WEIGHT_BITS),
                chunks=8, tokens=256, seed=0, threads=2, timing_batches=[1, 16], timing_context=128,
                timing_steps=32, task_tokens=GATE_DEFAULTS["task_tokens"])


def matching_export(checkpoint: Checkpoint, directory: Path, precision: str) -> Path:
    try:
        if export_matches(ExportedModel.open(directory), checkpoint, precision):
            return directory
    except (ManifestError, FileNotFoundError):
        pass
    print(f"exporting {precision} -> {directory}", flush=True)
    export_checkpoint(checkpoint, directory, precision)
    return directory


def held_out_rows(checkpoint: Checkpoint, chunks: int, tokens: int, seed: int) -> np.ndarray:
    """[chunks, tokens]: BOS then held-out text, `tokens` a multiple of the pair size."""
    tokenizer, pair = checkpoint.tokenizer, checkpoint.config.pair_size
    if tokens % pair:
        raise SystemExit(f"--tokens {tokens} is not a multiple of the pair size {pair}")
    stream = stdlib_chunks("report", chunk_chars=6 * tokens, seed=seed)
    rows = []
    while len(rows) < chunks:
        ids = tokenizer.encode(next(stream))
        if len(ids) >= tokens - 1:
            rows.append([tokenizer.bos_id, *ids[:tokens - 1]])
    return np.array(rows, np.int64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis."""
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def teacher_forced(directory: Path, rows: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """NLL and top token of each backbone prediction, [chunks, latents - 1]: the logits after latent i
    predict the first token of pair i + 1."""
    engine = OnnxComponents(directory, threads, max_sequences=len(rows))
    pair = engine.pair_size
    latents = engine.compress(rows.reshape(-1, pair)).reshape(len(rows), -1, engine.backbone.d_model)  # [B, n, D]
    count = latents.shape[1]
    gold = rows[:, pair::pair]  # [B, n - 1]
    ids = list(range(1, len(rows) + 1))
    runner = engine.backbone
    logits = np.stack([runner.prefill(seq_id, latents[row, :1], count).logits for row, seq_id in enumerate(ids)])
    nll, top = np.zeros(gold.shape), np.zeros(gold.shape, np.int64)
    for index in tqdm(range(count - 1), desc=directory.name, leave=False):
        if index > 0:
            logits = np.stack([out.logits for out in runner.step(ids, latents[:, index])])  # [B, V]
        log_probs = log_softmax(logits)
        nll[:, index] = -log_probs[np.arange(len(rows)), gold[:, index]]
        top[:, index] = logits.argmax(-1)
    return nll, top


def graph_summary(path: Path) -> str:
    """Quantized and fp32 constant-weight matrix products, and what multiplies by the LM head (the product
    whose output has the vocabulary's width)."""
    model = onnx.load(str(path))
    graph = model.graph
    ops = Counter(node.op_type for node in graph.node)
    fp32 = len(constant_weight_matmuls(model))
    weights = {tensor.name: tensor for tensor in graph.initializer}
    products = [node for node in graph.node if node.op_type in ("MatMulNBits", "MatMulInteger", "MatMul")
                and len(node.input) > 1 and node.input[1] in weights]
    head = max(products, key=lambda node: weights[node.input[1]].dims[0] if node.op_type == "MatMulNBits"
               else weights[node.input[1]].dims[-1])
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    shape = (f"K={attributes['K']} N={attributes['N']} bits={attributes['bits']}" if attributes else
             f"{onnx.helper.tensor_dtype_to_np_dtype(weights[head.input[1]].data_type)} weight "
             f"{list(weights[head.input[1]].dims)}")
    return (f"{ops['MatMulNBits']} MatMulNBits, {ops['MatMulInteger']} MatMulInteger, {fp32} constant-weight "
            f"MatMul/Gemm left in fp32; LM head: {head.op_type} ({shape})")


def sizes_mb(directory: Path) -> dict[str, float]:
    return {part.name: sum(f.stat().st_size for f in part.iterdir() if f.name != "manifest.json") / 1e6
            for part in sorted(directory.iterdir()) if part.is_dir()}


def step_times(directories: dict[str, Path], rows: np.ndarray, batch: int, context: int, steps: int,
               threads: int, rounds: int = 4) -> dict[str, list[float]]:
    """Seconds per decode step of `batch` sequences after `context` latents. Precisions take turns in
    `rounds` runs of steps / rounds consecutive steps each (turns step by step would time each
    session's thread pool waking up beside the others', not the step), after two warm-up steps."""
    engines = {p: OnnxComponents(d, threads, max_sequences=batch) for p, d in directories.items()}
    pair = next(iter(engines.values())).pair_size
    per_round = -(-steps // rounds)
    total = context + rounds * (per_round + 2)
    tokens = np.resize(rows, (batch, (total + 1) * pair))  # the held-out rows, repeated as needed
    times, latents, positions = {p: [] for p in engines}, {}, {}
    for precision, engine in engines.items():
        latents[precision] = engine.compress(tokens.reshape(-1, pair)).reshape(batch, -1, engine.backbone.d_model)
        for seq_id in range(1, batch + 1):
            engine.backbone.prefill(seq_id, latents[precision][seq_id - 1, :context], total + 1)
        positions[precision] = context
    ids = list(range(1, batch + 1))
    for _ in tqdm(range(rounds), desc=f"timing batch {batch}", leave=False):
        for precision, engine in engines.items():
            for step in range(per_round + 2):
                index = positions[precision]
                started = time.perf_counter()
                engine.backbone.step(ids, latents[precision][:, index])
                if step >= 2:
                    times[precision].append(time.perf_counter() - started)
                positions[precision] += 1
    return times


def task_answers(directory: Path, questions: list, max_tokens: int, threads: int) -> list[str]:
    """Greedy answers of the export to each question under its chat template."""
    engine = OnnxComponents(directory, threads, max_sequences=1)
    tokenizer = engine.exported.tokenizer()
    return [generate_text(engine, tokenizer, tokenizer.user_turn(question), SamplingParams(max_tokens=max_tokens),
                          1.0).text for question, _ in questions]


def print_task_check(directories: dict[str, Path], max_tokens: int, threads: int) -> None:
    questions = task_questions()
    answers = {p: task_answers(d, questions, max_tokens, threads) for p, d in directories.items()}
    reference = answers.get("fp32")
    print(f"\ntask check: {len(questions)} short chat questions ({Path(GATE_DEFAULTS['questions']).name}), greedy, "
          f"at most {max_tokens} tokens")
    print(" weights | right | answers identical to fp32's")
    for precision, texts in answers.items():
        right = sum(answered_right(text, accepted) for text, (_, accepted) in zip(texts, questions))
        same = f"{sum(a == b for a, b in zip(texts, reference))}/{len(texts)}" if reference else "-"
        print(f" {precision:>7} | {right:5} | {same}")


def first_tokens(directory: Path, question: str, threads: int, count: int = 5) -> list[tuple[int, str, float]]:
    """The `count` likeliest first tokens of the export's answer to `question` under its chat template: token
    id, text and log-probability."""
    engine = OnnxComponents(directory, threads, max_sequences=1)
    tokenizer = engine.exported.tokenizer()
    ids = np.array(tokenizer.encode_prompt(tokenizer.user_turn(question)), np.int64)
    pair = engine.pair_size
    if len(ids) % pair:
        raise SystemExit(f"--first-tokens {question!r}: {len(ids)} prompt tokens, not whole pairs of {pair}")
    logits = engine.backbone.prefill(1, engine.compress(ids.reshape(-1, pair)), 0).logits.astype(np.float64)
    log_probs = log_softmax(logits)
    return [(int(token), tokenizer.decode([int(token)]), float(log_probs[token]))
            for token in np.argsort(-log_probs)[:count]]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULTS["checkpoint"]))
    parser.add_argument("--export-dir", default=str(DEFAULTS["export_dir"]))
    parser.add_argument("--precisions", nargs="+", choices=list(WEIGHT_BITS), default=DEFAULTS["precisions"])
    parser.add_argument("--chunks", type=int, default=DEFAULTS["chunks"])
    parser.add_argument("--tokens", type=int, default=DEFAULTS["tokens"], help="per chunk, BOS included")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--threads", type=int, default=DEFAULTS["threads"])
    parser.add_argument("--timing", action="store_true", help="also time decode steps")
    parser.add_argument("--timing-batches", type=int, nargs="+", default=DEFAULTS["timing_batches"])
    parser.add_argument("--timing-context", type=int, default=DEFAULTS["timing_context"], help="latents")
    parser.add_argument("--timing-steps", type=int, default=DEFAULTS["timing_steps"])
    parser.add_argument("--task-check", action="store_true", help="also ask each export the task check's questions")
    parser.add_argument("--task-tokens", type=int, default=DEFAULTS["task_tokens"])
    parser.add_argument("--first-tokens", metavar="QUESTION", action="append", default=[],
                        help="also print each export's likeliest first answer tokens to QUESTION (repeatable)")
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(args.checkpoint)
    name = Path(args.checkpoint).name
    directories = {p: matching_export(checkpoint, Path(args.export_dir) / f"{name}-{p}", p) for p in args.precisions}
    rows = held_out_rows(checkpoint, args.chunks, args.tokens, args.seed)
    results = {p: teacher_forced(d, rows, args.threads) for p, d in directories.items()}

    print(f"{name} (checkpoint {checkpoint.id}): teacher-forced NLL of held-out text (stdlib 'report' split, seed "
          f"{args.seed}), {args.chunks} chunks x {args.tokens} tokens, {results[args.precisions[0]][0].size} "
          f"backbone predictions; ONNX Runtime, {args.threads} threads")
    reference = results.get("fp32")
    print(" weights | NLL (nats/token) | vs fp32 | top-1 = fp32 | files, MB")
    for precision, (nll, top) in results.items():
        sizes = sizes_mb(directories[precision])
        delta = f"{nll.mean() - reference[0].mean():+.4f}" if reference else "-"
        agree = f"{(top == reference[1]).mean():.3f}" if reference else "-"
        parts = ", ".join(f"{part} {mb:.1f}" for part, mb in sizes.items() if mb >= 0.1)
        print(f" {precision:>7} | {nll.mean():16.4f} | {delta:>7} | {agree:>12} | {sum(sizes.values()):.1f} ({parts})")
    for precision, directory in directories.items():
        quantization = ExportedModel.open(directory).settings.get("weight_quantization", "none")
        print(f" {precision} backbone: {graph_summary(directory / 'backbone' / 'model.onnx')}; "
              f"weight_quantization {quantization}")

    for question in args.first_tokens:
        print(f"\nfirst answer token to {question!r} under the chat template: top 5, log-probability")
        for precision, directory in directories.items():
            likeliest = first_tokens(directory, question, args.threads)
            print(f" {precision:>7} | " + "  ".join(f"{text!r} {value:.2f}" for _, text, value in likeliest))
    if args.task_check:
        print_task_check(directories, args.task_tokens, args.threads)
    if args.timing:
        print(f"\ndecode step, ms, median (p10-p90) of {args.timing_steps}, after {args.timing_context} latents, "
              f"precisions taking turns in 4 runs of consecutive steps")
        for batch in args.timing_batches:
            times = step_times(directories, rows, batch, args.timing_context, args.timing_steps, args.threads)
            cells = []
            for precision, values in times.items():
                median, low, high = median_and_spread(values)
                cells.append(f"{precision} {median * 1e3:.2f} ({low * 1e3:.2f}-{high * 1e3:.2f})")
            print(f" batch {batch:>2}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
