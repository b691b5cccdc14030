"""The gate's text figures (builder.evaluate_conversion.text_figures: the NLL gap at threshold 1.0 and the
top-token agreement) on more rows of the report split than the gate's 8, for one merged checkpoint.

    PYTHONPATH=. .venv/bin/python reports/conversion_recipes/short_answers/text_rows.py MERGED_CHECKPOINT ROWS"""
import sys
from argparse import Namespace

import torch

from builder.evaluate_conversion import DEFAULTS, text_figures
from dualend.engine.checkpoint import load_checkpoint

torch.set_num_threads(1)
dualend, baseline = load_checkpoint(sys.argv[1]), load_checkpoint(DEFAULTS["baseline"])
rows = int(sys.argv[2])
text = text_figures(dualend, baseline, 1.0, Namespace(**{**DEFAULTS, "text_rows": rows}))
agree = text["top_token_agreement"]
print(f"{sys.argv[1]}: {rows} rows x {DEFAULTS['text_tokens']} tokens: NLL gap "
      f"{text['nll_dualend'] - text['nll_baseline']:.4f} (baseline {text['nll_baseline']}, dual-end "
      f"{text['nll_dualend']}); top-token agreement {(agree['agree_t1'] + agree['agree_t2']) / 2:.4f} "
      f"(t1 {agree['agree_t1']}, t2 {agree['agree_t2']})")
