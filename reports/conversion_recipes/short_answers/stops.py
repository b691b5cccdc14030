"""Where the base's greedy answer to a task-check question ends (EOS within 48 tokens), the converted
model's probability of EOS there, its answer teacher-forced with drafting off (every pair (t, PAD)); the
first two such answers shown.
    PYTHONPATH=. .venv/bin/python reports/conversion_recipes/short_answers/stops.py MERGED_CHECKPOINT
"""
import statistics
import sys

import numpy as np
import torch

from builder.evaluate_conversion import task_questions
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.reference import TorchBatch, generate_batch

torch.set_num_threads(1)
base, dual = load_checkpoint("build/checkpoints/smollm2"), load_checkpoint(sys.argv[1])
tok, pad, eos = base.tokenizer, dual.config.pad_id, base.tokenizer.eos_id
prompts = [tok.encode_prompt(tok.user_turn(q)) for q, _ in task_questions()]
answers = generate_batch(TorchBatch(base.model, prompts, 48), [SamplingParams(max_tokens=48)] * len(prompts), 1.0)
probability, top = [], 0
for prompt, answer in zip(prompts, answers):
    if answer.finish_reason != "eos":
        continue
    batch = TorchBatch(dual.model, [prompt], 64)
    logits, _ = batch.restart()
    for t in answer.tokens:
        logits, _ = batch.step(np.array([[t, pad]]))
    p = torch.from_numpy(logits[0]).float().softmax(-1)
    probability.append(float(p[eos]))
    top += int(p.argmax()) == eos
    if len(probability) <= 2:
        print(f"{tok.decode(answer.tokens)!r}: EOS {probability[-1]:.4f}, top token {tok.decode([int(p.argmax())])!r}")
print(f"{sys.argv[1]}: the base ends {len(probability)} of {len(prompts)} answers within 48 tokens; there the "
      f"converted model's EOS probability: median {statistics.median(probability):.4f}, "
      f"quartiles {np.percentile(probability, 25):.4f}-{np.percentile(probability, 75):.4f}; EOS its top token at {top}")
