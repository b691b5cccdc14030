"""The gate's text figures (builder.evaluate_conversion.text_figures: the NLL gap at threshold 1.0 and the
top-token agreement) on ROWS rows of the report split, for merged checkpoints; with more than one, each
one's per-row NLL gap against the first's, paired row by row, with its standard error.

    PYTHONPATH=. .venv/bin/python reports/conversion_recipes/short_answers/text_rows.py ROWS MERGED [MERGED ...]"""
import sys
from argparse import Namespace

import torch

from builder.evaluate_conversion import DEFAULTS, standard_error, text_figures
from dualend.engine.checkpoint import load_checkpoint

torch.set_num_threads(1)
rows, paths = int(sys.argv[1]), sys.argv[2:]
baseline = load_checkpoint(DEFAULTS["baseline"])
by_row = []
for path in paths:
    text = text_figures(load_checkpoint(path), baseline, 1.0, Namespace(**{**DEFAULTS, "text_rows": rows}))
    agree = text["top_token_agreement"]
    by_row.append(text["nll_gap_by_row"])
    print(f"{path}: {rows} rows x {DEFAULTS['text_tokens']} tokens: NLL gap "
          f"{text['nll_dualend'] - text['nll_baseline']:.4f} (standard error over rows "
          f"{standard_error(text['nll_gap_by_row'])}; baseline {text['nll_baseline']}, dual-end "
          f"{text['nll_dualend']}); top-token agreement {(agree['agree_t1'] + agree['agree_t2']) / 2:.4f} "
          f"(t1 {agree['agree_t1']}, t2 {agree['agree_t2']})", flush=True)
for path, gaps in zip(paths[1:], by_row[1:]):
    differences = [g - f for g, f in zip(gaps, by_row[0])]
    print(f"{path} minus {paths[0]}, row by row: mean {sum(differences) / rows:+.4f}, standard error "
          f"{standard_error(differences)}; over the first 8 rows {sum(differences[:8]) / 8:+.4f}, standard error "
          f"{standard_error(differences[:8])}")
