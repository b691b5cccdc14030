"""Verified drafts in-process: acceptance, tokens per step, and speed against the base, one run.

    python -m benchmarks.draft_acceptance --base build/export/smollm2_w8a8 --drafting build/export/smollm2_mtp_w8a8
    python -m benchmarks.draft_acceptance --base build/export/smollm2_int4 --drafting build/export/smollm2_mtp_int4 \
        --thresholds 0 0.3 0.5
    python -m benchmarks.draft_acceptance ... --prompt-set text --min-acceptance 0 0.3

Prompts (`--prompt-set`): `chat`, the project's held-out task questions under the chat template (the
calibration split the draft head's training held out, `conversion.chat_prompts`); `open`, held-out
open-ended requests under the chat template (explain, describe, advise, write: `open_prompts`, topics
training never saw); or `text`, the first
48 tokens of held-out standard-library text windows as raw continuations (the draft head saw chat
answers and code only: low acceptance); greedy to EOS or `--max-tokens`. For each threshold (the least
top probability a draft needs to be fed) and each `--min-acceptance` (the draft pacing:
`decode.DraftPacer`, 0 = off) it decodes every prompt with the base
(no drafts) and with the draft head, alternating prompt by prompt so both see the same machine, and
prints: output identical to the base's (it must be, every prompt), drafts fed, the share kept (the
first-draft acceptance), tokens per step, and output tokens/s of each with their ratio (median and
10th-90th percentile across prompts). One sequence at a time: the single-stream case. Nothing else
should run meanwhile; the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from dualend.engine.decode import SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.serving.offline import generate_text
from dualend.train.conversion import chat_prompts, held_out_samples
from dualend.train.open_prompts import open_prompts

TEXT_PROMPT_TOKENS = 48


def percentiles(values: list[float]) -> str:
    low, mid, high = np.percentile(values, [10, 50, 90])
    return f"{mid:.3f} [{low:.3f}-{high:.3f}]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the base's export (no draft head)")
    parser.add_argument("--drafting", required=True, help="the same model with its draft head, exported")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0])
    parser.add_argument("--min-acceptance", type=float, nargs="+", default=[0.0])
    parser.add_argument("--prompt-set", choices=("chat", "open", "text"), default="chat")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    base, drafting = OnnxComponents(args.base, args.threads), OnnxComponents(args.drafting, args.threads)
    tokenizer = base.exported.tokenizer()
    if args.prompt_set in ("chat", "open"):
        questions = (chat_prompts("calibration", args.prompts, seed=0) if args.prompt_set == "chat"
                     else open_prompts("held_out", seed=1)[:args.prompts])
        prompts = [tokenizer.user_turn(q) for q in questions]
    else:
        prompts = [tokenizer.decode((sample.prompt + sample.completion)[1:TEXT_PROMPT_TOKENS])  # after BOS
                   for sample in held_out_samples(tokenizer, args.prompts, 2 * TEXT_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=args.max_tokens)
    generate_text(base, tokenizer, prompts[0], params, 1.0)  # warm-up: first calls allocate
    generate_text(drafting, tokenizer, prompts[0], params, 0.0)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {len(prompts)} held-out {args.prompt_set} prompts, greedy, "
          f"at most {args.max_tokens} tokens; {args.base} vs {args.drafting}")
    for threshold, min_acceptance in ((t, m) for t in args.thresholds for m in args.min_acceptance):
        same = drafts = kept = tokens = steps = 0
        base_rates, draft_rates, ratios = [], [], []
        for prompt in prompts:
            started = time.perf_counter()
            expected = generate_text(base, tokenizer, prompt, params, 1.0)
            middle = time.perf_counter()
            got = generate_text(drafting, tokenizer, prompt, params, threshold, draft_min_acceptance=min_acceptance)
            ended = time.perf_counter()
            same += got.tokens == expected.tokens
            drafts, kept = drafts + got.drafts, kept + got.accepted
            tokens, steps = tokens + len(got.tokens), steps + got.steps
            base_rates.append(len(expected.tokens) / (middle - started))
            draft_rates.append(len(got.tokens) / (ended - middle))
            ratios.append(draft_rates[-1] / base_rates[-1])
        print(f"threshold {threshold:g}, min acceptance {min_acceptance:g}: identical to the base {same}/{len(prompts)}; drafts fed {drafts}, kept "
              f"{kept} ({kept / max(drafts, 1):.3f}); {tokens / max(steps, 1):.3f} tokens/step; tokens/s base "
              f"{percentiles(base_rates)}, drafting {percentiles(draft_rates)}, ratio {percentiles(ratios)}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
