"""benchmarks.weight_precision on a tiny dual-end model: each precision's export measured against fp32's."""
import json
import math
import re
from pathlib import Path

import pytest

from benchmarks import weight_precision
from builder.evaluate_conversion import DEFAULTS as GATE_DEFAULTS
from conftest import tiny_model
from dualend.engine.checkpoint import Checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.tokenizer import BOS, EOS, PAD, TextTokenizer
from dualend.serving.offline import generate_text


def test_each_precision_is_measured_against_fp32_and_its_export_reused(tiny_tokenizer, tmp_path, capsys):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = TextTokenizer(tiny_tokenizer.tokenizer, {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
                                                         "add_bos_token": True, "chat_template": template})
    Checkpoint(tiny_model(tokenizer, 2, seed=1), tokenizer).save(tmp_path / "tiny")
    options = ["--checkpoint", str(tmp_path / "tiny"), "--export-dir", str(tmp_path / "exports"),
               "--precisions", "fp32", "int4", "--chunks", "2", "--tokens", "32", "--threads", "1"]
    weight_precision.main([*options, "--task-check", "--task-tokens", "4", "--timing", "--timing-batches", "1",
                           "--timing-context", "4", "--timing-steps", "4"])
    out = capsys.readouterr().out
    assert out.count("exporting") == 2 and "2 chunks x 32 tokens, 30 backbone predictions" in out
    rows = dict(re.findall(r"^ +(fp32|int4) \| +([-\d. |+]+?) \| [\d.]+ \(", out, re.M))
    fp32_nll, fp32_delta, fp32_agree = (cell.strip() for cell in rows["fp32"].split("|"))
    int4_nll, int4_delta, int4_agree = (cell.strip() for cell in rows["int4"].split("|"))
    assert (fp32_delta, fp32_agree) == ("+0.0000", "1.000")  # fp32 against itself
    assert abs(float(int4_delta) - (float(int4_nll) - float(fp32_nll))) <= 1.5e-4  # each printed to 4 places
    # int4 approximates fp32's weights: its NLL near fp32's (this model: -0.0006 nats when written)
    assert math.isfinite(float(int4_nll)) and abs(float(int4_delta)) < 0.05
    assert re.search(r"int4 backbone: [1-9]\d* MatMulNBits", out) and re.search(r"fp32 backbone: 0 MatMulNBits", out)
    questions = len(json.loads(Path(GATE_DEFAULTS["questions"]).read_text(encoding="utf-8"))["questions"])
    assert re.search(rf"^ +fp32 \| +\d+ \| {questions}/{questions}$", out, re.M)  # fp32's answers are fp32's
    assert re.search(r"^ batch +1: fp32 [\d.]+ \([\d.]+-[\d.]+\) \| int4 [\d.]+", out, re.M)
    weight_precision.main(options)
    assert "exporting" not in capsys.readouterr().out  # the exports match the checkpoint: reused


def test_the_first_answer_tokens_are_the_likeliest_with_the_greedy_answers_first(tiny_tokenizer, tmp_path, capsys):
    """The question under the chat template; a prompt of odd length leaves no whole pairs for this pair model."""
    template = "{% for m in messages %}Q: {{ m['content'] }} A:{% endfor %}"
    tokenizer = TextTokenizer(tiny_tokenizer.tokenizer, {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
                                                         "add_bos_token": True, "chat_template": template})
    Checkpoint(tiny_model(tokenizer, 2, seed=1), tokenizer).save(tmp_path / "tiny")
    by_parity = {len(tokenizer.encode_prompt(tokenizer.user_turn(text))) % 2: text
                 for text in (f"Name a colour{'!' * n}" for n in range(6))}
    assert set(by_parity) == {0, 1}, "the candidate questions should give prompts of both parities"
    even, odd = by_parity[0], by_parity[1]
    weight_precision.main(["--checkpoint", str(tmp_path / "tiny"), "--export-dir", str(tmp_path / "exports"),
                           "--precisions", "fp32", "--chunks", "1", "--tokens", "8", "--threads", "1",
                           "--first-tokens", even])
    assert re.search(rf"first answer token to {even!r}.*\n +fp32 \| ('.*' -?\d+\.\d\d +){{4}}'.*' -?\d+\.\d\d$",
                     capsys.readouterr().out, re.M)
    directory = tmp_path / "exports" / "tiny-fp32"
    top = weight_precision.first_tokens(directory, even, 1)
    values = [value for _, _, value in top]
    assert len(top) == 5 and values == sorted(values, reverse=True)
    every = weight_precision.first_tokens(directory, even, 1, count=tokenizer.vocab_size)
    assert abs(math.log(sum(math.exp(value) for _, _, value in every))) < 1e-6  # a distribution over the vocabulary
    engine = OnnxComponents(directory, 1, max_sequences=1)
    greedy = generate_text(engine, tokenizer, tokenizer.user_turn(even), SamplingParams(max_tokens=1, ignore_eos=True),
                           1.0)
    assert greedy.tokens == [top[0][0]] and top[0][1] == tokenizer.decode([top[0][0]])
    with pytest.raises(SystemExit, match="not whole pairs of 2"):
        weight_precision.first_tokens(directory, odd, 1)
