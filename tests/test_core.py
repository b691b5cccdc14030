"""Fast unit tests of the core: data, tokenizer, model, decode loop, training, checkpoints."""
import itertools
import random

import numpy as np
import pytest
import torch
from conftest import tiny_model

from builder.train import convert_baseline
from builder.train import main as train_main
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.decode import (
    BackboneOutput,
    InvalidRequest,
    SamplingParams,
    TextStream,
    gate,
    pad_prompt,
)
from dualend.engine.reference import TorchBatch, TorchComponents, generate_batch, reference_generate, reference_text
from dualend.serving.repository import max_sequence_latents
from dualend.train.data import (
    FAMILIES,
    Example,
    examples,
    extract_answer,
    question,
    run_python,
    sized_examples,
    split_of,
)
from dualend.train.evaluation import (Outcome, TextLoss, outcome, paired_difference, reliability, summary,
                                     teacher_forced_text, tokens_per_step)
from dualend.train.training import (
    IGNORE,
    MAX_COMPLETION_TOKENS,
    Sample,
    baseline_batch,
    baseline_forward,
    baseline_loss,
    copy_sample,
    dualend_batch,
    dualend_loss,
    dualend_row,
    gated_pairs,
    lookup_sample,
    more_queries,
    sample_stream,
    split_pairs,
    teacher_targets,
)

PAD, BOS, EOS = 0, 1, 2
VOCAB = 10


# ---- data ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_train_calibration_and_report_splits_are_disjoint(family):
    train = {e.prompt for e in itertools.islice(examples(family, "train", seed=3), 3000)}
    calibration = {e.prompt for e in itertools.islice(examples(family, "calibration", seed=3), 200)}
    report = {e.prompt for e in itertools.islice(examples(family, "report", seed=4), 200)}
    assert train and calibration and report
    assert not train & calibration and not train & report and not calibration & report
    assert all(split_of(family, p) == "report" for p in report)


@pytest.mark.parametrize("family", FAMILIES)
def test_sized_examples_are_in_range_and_keep_their_split(family):
    def count(prompt):
        return len(prompt.split())

    long = list(itertools.islice(sized_examples(family, "report", 0, count, 150, 220), 20))
    assert all(150 <= count(e.prompt) <= 220 for e in long)
    train_questions = {question(e) for e in itertools.islice(examples(family, "train", seed=0), 3000)}
    assert all(split_of(family, question(e)) == "report" for e in long)
    assert not {question(e) for e in long} & train_questions
    for example in long:  # the question is never among the solved examples before it
        assert f"{question(example)}{example.completion}" not in example.prompt
    if family == "math":
        for example in long:  # every solved example in the prompt is worked right
            for shot in example.prompt.split("\n\n")[:-1]:
                asked, answer = shot.removeprefix("Q: ").split("\nA:")
                assert extract_answer("math", answer) == str(eval(asked))


def test_math_answers_are_right():
    for example in itertools.islice(examples("math", "train", 0), 200):
        expression = example.prompt.removeprefix("Q: ").removesuffix("\nA:")
        assert int(example.answer) == eval(expression)  # independent check of the worked steps
        assert extract_answer("math", example.completion) == example.answer


def test_code_answers_come_from_running_the_code():
    example = next(examples("code", "train", 0))
    assert example.answer == run_python(example.prompt.removesuffix("\n# output:"))


def test_lookup_answer_is_the_value_of_the_queried_key():
    for example in itertools.islice(examples("lookup", "train", 0), 100):
        context, query = example.prompt.split("\nget ")
        table = dict(item.split(":") for item in context.removeprefix(" ").split(" "))
        assert table[query.removesuffix(":")] == example.answer == example.completion


def test_a_misread_lookup_digit_is_traced_to_the_nearest_entry_that_starts_with_it():
    from builder.copy_probe import misread_offset, random_reader_offsets

    example = Example("lookup", " aa:11 bb:52 cc:33 dd:54 ee:35\nget cc:", "33", "33")
    assert misread_offset(example, "3") == "right"
    assert misread_offset(example, "5") == -1  # bb:52 and dd:54 are both one away: the earlier wins
    assert misread_offset(example, "1") == -2
    assert misread_offset(example, "9") == "none"
    assert misread_offset(example, "") == "none"  # EOS decodes to nothing
    short = Example("lookup", " aa:11 bb:52 cc:33\nget cc:", "33", "33")
    counts = random_reader_offsets([short], draws=200)
    assert set(counts) == {-2, -1} and counts[-2] + counts[-1] == 1 and 0.3 < counts[-1] < 0.7


def test_extra_lookup_queries_train_each_value_and_stop_only_after_the_last(tiny_tokenizer):
    rng = random.Random(0)
    for example in itertools.islice(examples("lookup", "train", 0), 50):
        queries = more_queries(example, rng, 3)
        context = example.prompt.split("\nget ")[0] + " "
        assert all(f" {key}:{value} " in context for key, value in queries)
        sample = lookup_sample(tiny_tokenizer, example, queries)
        text = tiny_tokenizer.decode(sample.completion)
        assert text == example.completion + "".join(f"\nget {k}:{v}" for k, v in queries)
        trained = "".join(tiny_tokenizer.decode([t]) for i, t in enumerate(sample.completion) if i not in sample.silent)
        assert trained == example.completion + "".join(v for _, v in queries)  # values only, and EOS
        assert sample.completion[-1] == tiny_tokenizer.eos_id and len(sample.completion) - 1 not in sample.silent
        after_first = len(tiny_tokenizer.encode(example.completion))
        assert after_first in sample.silent  # the value asked first is never taught to go on


def test_a_copy_row_repeats_the_context_and_stops_training_where_it_is_cut(tiny_tokenizer):
    short = " ab:12 cd:34"
    sample = copy_sample(tiny_tokenizer, short)
    assert tiny_tokenizer.decode(sample.prompt + sample.completion) == short + "\n" + short
    assert sample.completion[-1] == tiny_tokenizer.eos_id and not sample.silent
    long = "".join(f" {a}{b}:{i % 100:02d}" for i, (a, b) in enumerate(zip("abcdefghijklmnopqrstuvwxyz" * 2, "qwertyuiopasdfghjklzxcvbnm" * 2)))
    cut = copy_sample(tiny_tokenizer, long)
    assert len(cut.completion) == MAX_COMPLETION_TOKENS and cut.silent == {MAX_COMPLETION_TOKENS - 1}
    assert ("\n" + long).startswith(tiny_tokenizer.decode(cut.completion[:-1]))


def test_silent_completion_tokens_carry_no_loss_in_either_model():
    sample = Sample(prompt=[BOS, 5, 6], completion=[7, 3, 4, 8, EOS], silent=frozenset({1, 2}))
    labels = baseline_batch([sample], PAD)["labels"][0].tolist()
    assert labels == [IGNORE, IGNORE, 7, IGNORE, IGNORE, 8, EOS, IGNORE]
    row = dualend_row(sample, PAD, reject_ratio=1.0, rng=random.Random(0))  # one token per pair
    assert row.pairs == [BOS, PAD, 5, 6, 7, PAD, 3, PAD, 4, PAD, 8, PAD, EOS, PAD]
    assert row.next_token == [IGNORE, 7, IGNORE, IGNORE, 8, EOS, IGNORE]
    assert row.draft_target == [IGNORE, IGNORE, IGNORE, 8, EOS, IGNORE, IGNORE]
    # the MTP head still reads every real token, as it does when serving: 4 (silent) predicts 8
    assert row.mtp_input == [PAD, 7, 3, 4, 8, EOS, PAD]


def test_lookup_key_is_the_same_tokens_in_context_and_query(tiny_tokenizer):
    for example in itertools.islice(examples("lookup", "train", 0), 50):
        key = example.prompt.split("\nget ")[1].removesuffix(":")
        query_ids = tiny_tokenizer.encode(f"\nget {key}:")
        key_ids = tiny_tokenizer.encode(f" {key}:")
        context_ids = tiny_tokenizer.encode(example.prompt.split("\nget ")[0])
        assert _contains(query_ids, key_ids) and _contains(context_ids, key_ids)


def test_short_math_and_code_rows_end_on_both_pair_parities(tiny_tokenizer):
    # A math question alone always tokenizes to the same parity; the dual-end model must also learn
    # prompts that end on (last token, PAD), so some rows follow solved examples.
    for family in ("math", "code"):
        rows = list(itertools.islice(sample_stream(tiny_tokenizer, 0, 0.0, 192, families=(family,)), 300))
        assert {len(row.prompt) % 2 for row in rows} == {0, 1}
        for row in rows:
            prompt = tiny_tokenizer.decode(row.prompt)
            asked = prompt.rsplit("\n\n", 1)[-1]
            answer = tiny_tokenizer.decode(row.completion[:-1])
            assert f"{asked}{answer}\n\n" not in prompt  # no solved example is the question itself
        assert any("\n\n" in tiny_tokenizer.decode(row.prompt) for row in rows)


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


# ---- tokenizer and text --------------------------------------------------------------------

def test_tokenizer_round_trips_and_strips_pad(tiny_tokenizer):
    text = "Q: 7+5-3\nA: 7+5=12 #9"
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    with_pads = [tiny_tokenizer.pad_id, *ids[:3], tiny_tokenizer.pad_id, *ids[3:], tiny_tokenizer.pad_id]
    assert tiny_tokenizer.decode(with_pads) == text


def test_text_stream_cuts_at_stop_word_split_across_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc STOP def")
    stream = TextStream(tiny_tokenizer, ["STOP"])
    groups = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(tiny_tokenizer.decode(g) for g in groups) == "abc " and stream.stopped


def test_text_stream_releases_whole_characters_only(tiny_tokenizer):
    ids = tiny_tokenizer.encode("é 1€")  # multi-byte characters split over byte-level tokens
    assert len(ids) > len("é 1€")
    stream = TextStream(tiny_tokenizer)
    groups = [stream.push([i]) for i in ids] + [stream.finish()]
    assert all("\ufffd" not in tiny_tokenizer.decode(g) for g in groups)
    assert "".join(tiny_tokenizer.decode(g) for g in groups) == "é 1€"


def test_text_stream_stops_at_a_stop_word_that_ends_in_a_character_split_across_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc a😀 def")  # the emoji is four byte-level tokens
    stream = TextStream(tiny_tokenizer, ["a😀"])
    groups = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(tiny_tokenizer.decode(g) for g in groups) == "abc " and stream.stopped


class CountingTokenizer:
    """The tokenizer, counting the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids):
        ids = list(ids)
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


@pytest.mark.parametrize("stop_at_end", [False, True])
def test_text_stream_decodes_each_token_a_bounded_number_of_times_with_a_long_stop_word(tiny_tokenizer, stop_at_end):
    stop = "#" * 200 + "é€ end"
    body = "".join(f"x{i} = {i} * 2  # é€\n" for i in range(300))
    ids = tiny_tokenizer.encode(body + (stop + " after" if stop_at_end else ""))
    counting = CountingTokenizer(tiny_tokenizer)
    stream = TextStream(counting, [stop])
    groups = [stream.push(ids[i:i + 2]) for i in range(0, len(ids), 2)] + [stream.finish()]
    assert counting.decoded <= 4 * len(ids)  # re-decoding the held-back window would be ~200x
    released = [tiny_tokenizer.decode(g) for g in groups]
    assert "".join(released) == body and stream.stopped == stop_at_end
    assert all("\ufffd" not in text for text in released)


# ---- decode loop on a scripted fake --------------------------------------------------------

def one_hot(token: int) -> np.ndarray:
    logits = np.full(VOCAB, -10.0, dtype=np.float32)
    logits[token] = 10.0
    return logits


class ScriptedComponents:
    """Backbone emits `script` one t1 per step; the MTP drafts `draft` with `confidence`."""

    pair_size, pad_id, eos_id, bos_id = 2, PAD, EOS, BOS

    def __init__(self, script, draft=7, confidence=0.9):
        self.script, self.draft, self.confidence = script, draft, confidence
        self.compressed, self.reserved, self.mtp_calls, self.open_sessions = [], [], 0, 0

    def compress(self, tokens):
        self.compressed.append(tokens.tolist())
        return np.zeros((len(tokens), 4), dtype=np.float32)

    def open_backbone(self):
        fake, position = self, iter(self.script)
        self.open_sessions += 1

        class Session:
            def prefill(self, latents, reserve_slots):
                fake.reserved.append(reserve_slots)
                return BackboneOutput(one_hot(next(position)), np.zeros(4))

            def step(self, latent):
                return BackboneOutput(one_hot(next(position)), np.zeros(4))

            def close(self):
                fake.open_sessions -= 1
        return Session()

    def open_mtp(self, max_steps):
        fake = self

        class Session:
            def step(self, t1, hidden, position):
                fake.mtp_calls += 1
                return one_hot(fake.draft), fake.confidence

            def close(self):
                pass
        return Session()


def test_an_odd_prompt_gets_one_pad_after_bos_so_its_last_token_completes_a_pair():
    assert pad_prompt([1, 5, 6], 2, PAD) == [1, PAD, 5, 6]
    assert pad_prompt([1, 5, 6, 7], 2, PAD) == [1, 5, 6, 7]
    assert pad_prompt([1, 5, 6], 1, PAD) == [1, 5, 6]
    fake = ScriptedComponents([3, EOS])
    list(reference_generate(fake, [BOS, 5, 6], SamplingParams(max_tokens=5), threshold=2.0))
    assert fake.compressed[0] == [[BOS, PAD], [5, 6]]


def test_gate_edges():
    assert gate(0.5, 0.5) and not gate(0.49, 0.5)
    assert gate(0.0, -0.1)                     # threshold < 0 always accepts
    fake = ScriptedComponents([3, 4, 5, EOS], confidence=1.0)
    steps = list(reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=20), threshold=1.0))
    assert fake.mtp_calls == 0                 # threshold >= 1: drafting off
    assert [s.tokens for s in steps[:-1]] == [[3], [4], [5]]
    assert fake.compressed[1:] == [[[3, PAD]], [[4, PAD]], [[5, PAD]]]


def test_accepted_drafts_give_two_tokens_per_step():
    fake = ScriptedComponents([3, 4, EOS], draft=7, confidence=0.9)
    steps = list(reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=20), threshold=0.5))
    assert [s.tokens for s in steps] == [[3, 7], [4, 7], []]
    assert all(s.accepted for s in steps[:2]) and steps[-1].finish_reason == "eos"
    assert fake.compressed[1:] == [[[3, 7]], [[4, 7]]]


def test_rejected_draft_feeds_pad():
    fake = ScriptedComponents([3, EOS], draft=7, confidence=0.2)
    steps = list(reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=20), threshold=0.5))
    assert steps[0].tokens == [3] and steps[0].drafted and not steps[0].accepted
    assert fake.compressed[1] == [[3, PAD]]


def test_the_largest_requests_fit_one_sequence_of_the_kv_budget():
    """What the decode loop reserves, for every split of the raw context between prompt and
    max_tokens, fits the per-sequence budget the repository is sized with."""
    raw_limit, max_new = 64, 40
    for max_tokens in range(1, max_new + 1):
        for pair_size in (1, 2):
            fake = ScriptedComponents([3] * max_tokens)
            fake.pair_size = pair_size
            prompt = [BOS] + [5] * (raw_limit - max_tokens - 1)
            list(reference_generate(fake, prompt, SamplingParams(max_tokens=max_tokens), threshold=1.0))
            assert fake.reserved[0] <= max_sequence_latents(raw_limit, max_new, pair_size)


def test_max_tokens_is_exact_and_sessions_close():
    fake = ScriptedComponents([3, 4, 5, 6, 8], draft=7, confidence=0.9)
    steps = list(reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=3), threshold=0.5))
    assert sum(len(s.tokens) for s in steps) == 3 and steps[-1].finish_reason == "length"
    assert fake.open_sessions == 0


def test_closing_the_stream_early_releases_the_backbone():
    fake = ScriptedComponents([3] * 10)
    stream = reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=20), threshold=0.5)
    next(stream)
    stream.close()
    assert fake.open_sessions == 0


def test_accepted_eos_draft_ends_generation():
    fake = ScriptedComponents([3, 4], draft=EOS, confidence=0.9)
    steps = list(reference_generate(fake, [BOS], SamplingParams(max_tokens=20), threshold=0.5))
    assert [s.tokens for s in steps] == [[3]] and steps[0].finish_reason == "eos"


def test_a_vocabulary_whose_bos_is_its_eos_ends_on_it_and_other_bos_never_come():
    from dualend.engine.decode import SequenceDecoder
    logits = np.zeros(8, np.float32)
    logits[5] = 10.0  # the model's top token: 5

    def first(eos, bos, **params):
        return SequenceDecoder(2, 0, eos, bos, SamplingParams(max_tokens=4, **params), 1.0, 1).first_token(logits)
    assert first(eos=5, bos=5) == 5  # GPT-2's <|endoftext|>: the answer ends
    assert first(eos=6, bos=5) != 5 and first(eos=5, bos=5, ignore_eos=True) != 5


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(stop_words=("",)), "stop_words"),
])
def test_bad_parameters_are_named(params, message):
    with pytest.raises(InvalidRequest, match=message):
        params.validate()


# ---- model ---------------------------------------------------------------------------------

def test_compressor_starts_as_the_pair_sum(tiny_tokenizer):
    model = tiny_model(tiny_tokenizer, pair_size=2)
    tokens = torch.tensor([[5, 9], [9, 5], [3, 3]])
    expected = model.embedding(tokens).sum(-2)
    assert torch.allclose(model.latents(tokens), expected, atol=1e-5)


@pytest.mark.parametrize("pair_size", [1, 2])
def test_cached_decoding_matches_full_forward(tiny_tokenizer, pair_size):
    model = tiny_model(tiny_tokenizer, pair_size)
    torch.manual_seed(1)
    sequence = torch.randint(3, tiny_tokenizer.vocab_size, (12 // pair_size, pair_size))
    latents = model.latents(sequence)
    with torch.no_grad():
        full, _, _ = model.backbone(latents[None], torch.arange(len(latents))[None],
                                    torch.ones(1, len(latents), dtype=torch.bool))
        session = TorchComponents(model).open_backbone()
        cached = [session.prefill(latents[:5].numpy(), 12).logits]
        cached += [session.step(latent.numpy()).logits for latent in latents[5:]]
    expected = model.lm_head(full[0, 4:]).detach().numpy()
    np.testing.assert_allclose(np.stack(cached), expected, atol=1e-4)


def test_cached_mtp_matches_training_forward(tiny_tokenizer):
    model = tiny_model(tiny_tokenizer, pair_size=2)
    torch.manual_seed(2)
    hidden = torch.randn(1, 6, 32)
    t1 = torch.randint(3, tiny_tokenizer.vocab_size, (1, 6))
    start = 2  # the MTP window opens at the last prompt pair
    positions = torch.arange(6)[None]
    with torch.no_grad():
        full, confidence, _, _ = model.mtp_forward(t1, hidden, positions, positions >= start)
        session = TorchComponents(model).open_mtp()
        cached = [session.step(int(t1[0, i]), hidden[0, i].numpy(), i) for i in range(start, 6)]
    np.testing.assert_allclose(np.stack([c[0] for c in cached]), full[0, start:].numpy(), atol=1e-4)
    np.testing.assert_allclose([c[1] for c in cached], confidence[0, start:].numpy(), atol=1e-5)


@pytest.mark.parametrize("pair_size", [1, 2])
def test_fixed_seed_reproduces_a_sampled_generation(tiny_tokenizer, pair_size):
    components = TorchComponents(tiny_model(tiny_tokenizer, pair_size))
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=11)
    first = reference_text(components, tiny_tokenizer, "Q: 1+2\nA:", params, threshold=0.3)
    again = reference_text(components, tiny_tokenizer, "Q: 1+2\nA:", params, threshold=0.3)
    other = reference_text(components, tiny_tokenizer, "Q: 1+2\nA:",
                          SamplingParams(**{**params.__dict__, "seed": 12}), threshold=0.3)
    assert first.tokens == again.tokens and len(first.tokens) > 0
    assert first.tokens != other.tokens


def test_generated_text_never_contains_pad(tiny_tokenizer):
    components = TorchComponents(tiny_model(tiny_tokenizer, 2))
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    out = reference_text(components, tiny_tokenizer, "get ab\nA:", params, threshold=0.99)
    assert tiny_tokenizer.pad_id not in out.tokens and "<pad>" not in out.text


def test_outcome_counts_eos_apart_from_tokens(tiny_tokenizer):
    """Drafting off is one token per step (EOS counted apart); accepted drafts add one each."""
    example = Example("lookup", "get ab\nA:", " 37", "37")
    params = SamplingParams(max_tokens=8)
    off = outcome(example, tiny_tokenizer,
                  [reference_text(ScriptedComponents([3, 4, EOS]), tiny_tokenizer, example.prompt, params, 1.0)])
    assert (off.tokens, off.eos, off.steps) == (2, 1, 3)
    scripted = ScriptedComponents([3, 4, EOS], draft=7, confidence=0.9)
    on = outcome(example, tiny_tokenizer, [reference_text(scripted, tiny_tokenizer, example.prompt, params, 0.5)])
    assert (on.tokens, on.eos, on.steps, on.accepted) == (4, 1, 3, 2)
    assert summary([off, on])["tokens_per_step_no_eos"] == 1.0


@pytest.mark.parametrize("pair_size,threshold", [(1, 1.0), (2, -1.0), (2, 0.5), (2, 1.0)])
def test_batched_generation_equals_one_at_a_time(tiny_tokenizer, pair_size, threshold):
    model = tiny_model(tiny_tokenizer, pair_size, seed=4)
    prompts = ["Q: 1+2\nA:", "get ab\nA:", " ab:12 cd:34 ef:56 gh:78\nget cd\nA:", "x"]
    params = [SamplingParams(max_tokens=n, temperature=t, seed=s) for n, t, s in
              ((12, 0.0, 0), (5, 1.0, 3), (9, 0.7, 5), (1, 0.0, 0))]
    batch = TorchBatch(model, [tiny_tokenizer.encode_prompt(p) for p in prompts], max_steps=12)
    batched = generate_batch(batch, params, threshold)
    again = generate_batch(batch, params, threshold)  # restarts from the same prefill
    components = TorchComponents(model)
    for prompt, p, got, repeat in zip(prompts, params, batched, again):
        want = reference_text(components, tiny_tokenizer, prompt, p, threshold)
        assert (got.tokens, got.steps, got.accepted, got.finish_reason) == \
            (want.tokens, want.steps, want.accepted, want.finish_reason)
        assert repeat.tokens == got.tokens


def test_paired_difference_interval_covers_the_mean_and_shrinks_with_agreement():
    def outcomes(flags):
        return [Outcome(bool(f), 1, 0, 1, 0, 0) for f in flags]

    control = outcomes([1] * 50 + [0] * 50)
    worse = paired_difference(outcomes([1] * 40 + [0] * 60), control)
    assert worse["diff"] == -0.1 and worse["low"] < -0.1 < worse["high"] <= 0
    same = paired_difference(control, control)
    assert same == {"diff": 0.0, "low": 0.0, "high": 0.0}


def test_reliability_of_a_calibrated_and_an_overconfident_head():
    rng = np.random.default_rng(0)
    confidence = rng.uniform(size=20000)
    calibrated = reliability(list(confidence), list(rng.uniform(size=20000) < confidence))
    overconfident = reliability(list(confidence), list(rng.uniform(size=20000) < confidence / 2))
    assert calibrated["ece"] < 0.02 and 0.2 < overconfident["ece"] < 0.3


def test_teacher_forced_text_matches_the_training_forward(tiny_tokenizer):
    """Baseline: the NLL of every token equals the whole-sequence forward's. Dual-end at -1: the
    backbone's NLLs are those of the training forward over plain pairs; at 1.0 no draft is used."""
    text = tiny_tokenizer.encode("Q: 7+5-3\nA: 7+5=12 12-3=9 #9 get ab")[:16]
    baseline = tiny_model(tiny_tokenizer, 1, seed=2)
    loss = teacher_forced_text(baseline, tiny_tokenizer.bos_id, [text], threshold=1.0)
    tokens = torch.tensor([[tiny_tokenizer.bos_id, *text]])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(baseline_forward(baseline, tokens)[0, :-1], tokens[0, 1:],
                                                 reduction="none")
    np.testing.assert_allclose(loss.nll[0], want.numpy(), atol=1e-4)
    dualend = tiny_model(tiny_tokenizer, 2, seed=2)
    accept_all = teacher_forced_text(dualend, tiny_tokenizer.bos_id, [text], threshold=-1.0)
    pairs = torch.tensor([tiny_tokenizer.bos_id, PAD, *text]).view(1, -1, 2)
    with torch.no_grad():
        hidden, _, _ = dualend.backbone(dualend.latents(pairs), torch.arange(pairs.shape[1])[None],
                                        torch.ones(1, pairs.shape[1], dtype=torch.bool))
        logits = dualend.lm_head(hidden)[0, :-1]  # pair i predicts text token 2i
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(text[0::2]), reduction="none")
    np.testing.assert_allclose(accept_all.nll[0, 0::2], want.numpy(), atol=1e-4)
    assert accept_all.by_draft[0, 1::2].all()
    drafting_off = teacher_forced_text(dualend, tiny_tokenizer.bos_id, [text], threshold=1.0)
    assert not drafting_off.by_draft.any()
    assert tokens_per_step(accept_all) == pytest.approx(len(text) / (len(text) // 2))
    assert tokens_per_step(drafting_off) == 1.0


def test_tokens_per_step_counts_each_rows_own_steps():
    """A row whose drafts are all kept takes 2 steps for 4 tokens while the other takes 4: 8 tokens in 6
    steps, not in the slowest row's 4 steps twice."""
    drafted = np.array([[False, True, False, True], [False, False, False, False]])
    loss = TextLoss(nll=np.zeros((2, 4)), by_draft=drafted, confidence=[], draft_right=[])
    assert tokens_per_step(loss) == pytest.approx(8 / 6)


# ---- training ------------------------------------------------------------------------------

def test_a_confident_draft_keeps_its_confidence_gradient_under_bf16_autocast(tiny_tokenizer):
    """bf16 rounds a sigmoid above ~0.998 to exactly 1: BCE would then give a large loss and no gradient."""
    head = tiny_model(tiny_tokenizer, 2, seed=2).confidence
    with torch.no_grad():
        head.net[-1].weight.zero_()
        head.net[-1].bias.fill_(7.0)  # sigmoid(7) = 0.99909
    hidden = torch.randn(1, 3, head.net[1].in_features // 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        confidence = head(hidden, hidden)
    assert confidence.dtype == torch.float32 and confidence[0].tolist() == pytest.approx([0.99909] * 3, abs=1e-5)
    torch.nn.functional.binary_cross_entropy(confidence, torch.full((1, 3), 0.6)).backward()
    assert head.net[-1].bias.grad.item() == pytest.approx(0.99909 - 0.6, abs=2e-3)  # p - target, in bf16


def test_dualend_row_targets_skip_pads():
    sample = Sample(prompt=[BOS, 5, 6], completion=[7, 8, 9, EOS])
    row = dualend_row(sample, PAD, reject_ratio=1.0, rng=random.Random(0))
    assert row.pairs == [BOS, PAD, 5, 6, 7, PAD, 8, PAD, 9, PAD, EOS, PAD]
    assert row.next_token == [IGNORE, 7, 8, 9, EOS, IGNORE]
    assert row.draft_target == [IGNORE, 8, 9, EOS, IGNORE, IGNORE]
    assert [row.real_tokens[i] for i in row.next_index[1:5]] == [7, 8, 9, EOS]
    assert gated_pairs([7, 8, 9], 0.0, PAD, random.Random(0)) == [7, 8, 9, PAD]


class ScriptedRng:
    def __init__(self, draws):
        self.draws = iter(draws)

    def random(self):
        return next(self.draws)


class TeacherForcedComponents(ScriptedComponents):
    """Backbone and MTP always propose the next tokens of `completion`; the MTP's confidence
    follows `confidences`, one per draft, so the gate's decisions are scripted."""

    def __init__(self, completion, confidences):
        super().__init__(script=[])
        self.completion, self.confidences = completion, iter(confidences)

    def _after(self, token):
        return self.completion[self.completion.index(token) + 1]

    def open_backbone(self):
        fake = self

        class Session:
            def prefill(self, latents, reserve_slots):
                return BackboneOutput(one_hot(fake.completion[0]), np.zeros(4))

            def step(self, latent):
                last = [t for t in fake.compressed[-1][0] if t != PAD][-1]
                return BackboneOutput(one_hot(fake._after(last)), np.zeros(4))

            def close(self):
                pass
        return Session()

    def open_mtp(self, max_steps):
        fake = self

        class Session:
            def step(self, t1, hidden, position):
                return one_hot(fake._after(t1)), next(fake.confidences)

            def close(self):
                pass
        return Session()


def test_gated_pairs_are_what_the_decode_loop_feeds_back():
    """Training sees the same pair boundaries as serving: a rejection shifts all later pairs."""
    completion = [3, 4, 5, 6, 7, 8, 9, EOS]
    accept = [True, False, True, False, False, True]
    fake = TeacherForcedComponents(completion, [0.9 if a else 0.1 for a in accept])
    list(reference_generate(fake, [BOS, 5], SamplingParams(max_tokens=20), threshold=0.5))
    served = [pair for (pair,) in fake.compressed[1:]]
    trained = gated_pairs(completion, 0.5, PAD, ScriptedRng([0.9 if a else 0.1 for a in accept]))
    trained_pairs = [trained[i:i + 2] for i in range(0, len(trained), 2)]
    assert served == [[3, 4], [5, PAD], [6, 7], [8, PAD], [9, PAD]]
    assert trained_pairs[:len(served)] == served
    assert trained_pairs[len(served)] == [EOS, PAD]


def test_gated_pairs_cover_both_extremes():
    assert gated_pairs([7, 8, 9, 4], 1.0, PAD, random.Random(0)) == [7, PAD, 8, PAD, 9, PAD, 4, PAD]
    assert gated_pairs([7, 8, 9, 4], 0.0, PAD, random.Random(0)) == [7, 8, 9, 4]


def test_split_pairs_ablation_keeps_pair_boundaries():
    """The earlier augmentation: a rejection splits a whole pair, so later pairs do not shift."""
    assert split_pairs([3, 4, 5, 6], 0.5, PAD, ScriptedRng([0.1, 0.9])) == [3, PAD, 4, PAD, 5, 6]
    assert gated_pairs([3, 4, 5, 6], 0.5, PAD, ScriptedRng([0.1, 0.9])) == [3, PAD, 4, 5, 6, PAD]


@pytest.mark.parametrize("pair_size", [1, 2])
def test_training_steps_lower_the_loss(tiny_tokenizer, pair_size):
    model = tiny_model(tiny_tokenizer, pair_size).train()
    samples = [Sample([BOS, 5 + i, 6], [7 + i, 8, 9, EOS]) for i in range(4)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss():
        if pair_size == 1:
            return baseline_loss(model, baseline_batch(samples, PAD))[0]
        return dualend_loss(model, dualend_batch(samples, PAD, random.Random(0), reject_ratio=0.5))[0]
    before = loss().item()
    for _ in range(20):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < 0.7 * before


def test_distillation_targets_are_the_teachers_distribution(tiny_tokenizer):
    teacher = tiny_model(tiny_tokenizer, 1, seed=5)
    batch = dualend_batch([Sample([BOS, 5, 6], [7, 8, 9, EOS])], PAD, random.Random(0), reject_ratio=0.0)
    with torch.no_grad():
        logits = baseline_forward(teacher, batch["real_tokens"])  # [1, 7, V]
    soft = teacher_targets(logits, batch["next_index"])
    # Pair 1 (the last prompt pair) targets real token 3 (the 7); the teacher predicted it at index 2.
    assert batch["next_index"][0, 1] == 3
    torch.testing.assert_close(soft[0, 1], logits[0, 2].softmax(-1))
    draft_soft = teacher_targets(logits, batch["draft_index"])
    torch.testing.assert_close(draft_soft[0, 1], logits[0, 3].softmax(-1))  # the 8, predicted at index 3


# ---- checkpoints ---------------------------------------------------------------------------

def test_checkpoint_round_trips_and_id_tracks_weights(tiny_tokenizer, tmp_path):
    model = tiny_model(tiny_tokenizer, 2)
    ckpt_id = Checkpoint(model, tiny_tokenizer, {"kind": "test"}).save(tmp_path / "a")
    loaded = load_checkpoint(tmp_path / "a")
    assert loaded.id == ckpt_id and loaded.recipe == {"kind": "test"}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name])
    with torch.no_grad():
        model.backbone.layers[0].ffn.down.weight[0, 0] += 1e-3
    assert Checkpoint(model, tiny_tokenizer).id != ckpt_id


def test_merge_moves_the_dual_end_model_by_what_the_baseline_learned(tmp_path, tiny_tokenizer):
    before = tiny_model(tiny_tokenizer, 1, seed=1)
    dualend = convert_baseline(before, "sum", position_stride=2)
    after = tiny_model(tiny_tokenizer, 1, seed=1)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = {name: Checkpoint(model, tiny_tokenizer, {"kind": name, "context": 64}).save(tmp_path / name)
           for name, model in (("before", before), ("after", after))}
    Checkpoint(dualend, tiny_tokenizer, {"kind": "dualend", "converted_from": ids["before"]}).save(tmp_path / "dual")
    train_main(["merge", "--dualend", str(tmp_path / "dual"), "--baseline-before", str(tmp_path / "before"),
                "--baseline-after", str(tmp_path / "after"), "--out", str(tmp_path / "merged")])
    merged = load_checkpoint(tmp_path / "merged")
    want = dualend.backbone.layers[0].attn.qkv.weight + after.backbone.layers[0].attn.qkv.weight \
        - before.backbone.layers[0].attn.qkv.weight
    torch.testing.assert_close(merged.model.backbone.layers[0].attn.qkv.weight, want)
    torch.testing.assert_close(merged.model.compressor.up.weight, dualend.compressor.up.weight)
    assert merged.recipe["converted_from"] == ids["after"] and merged.recipe["context"] == 64
    with pytest.raises(SystemExit, match="was converted from"):
        train_main(["merge", "--dualend", str(tmp_path / "merged"), "--baseline-before", str(tmp_path / "before"),
                    "--baseline-after", str(tmp_path / "after"), "--out", str(tmp_path / "again")])


def test_the_schedule_warms_up_then_follows_steps_or_time_whichever_is_further():
    from types import SimpleNamespace

    from builder.train import lr_at, run_progress

    assert lr_at(0, 0.0, 1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at(10, 0.0, 1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at(50, 0.5, 1.0, warmup=10) == pytest.approx(0.55)  # half-way down the cosine to a tenth
    assert lr_at(99, 1.0, 1.0, warmup=10) == lr_at(99, 3.0, 1.0, warmup=10) == pytest.approx(0.1)
    by_steps = SimpleNamespace(warmup=10, steps=110, time_limit_minutes=0.0)
    assert run_progress(by_steps, 60, elapsed_s=1e6) == pytest.approx(0.5)
    by_time = SimpleNamespace(warmup=10, steps=110, time_limit_minutes=1.0)
    assert run_progress(by_time, 20, elapsed_s=45) == pytest.approx(0.75)
    assert run_progress(by_time, 100, elapsed_s=6) == pytest.approx(0.9)


def test_batch_workers_hand_out_their_own_seeds_batches_and_end_when_the_stream_closes(tiny_tokenizer):
    import multiprocessing

    from dualend.train.training import batch_stream, batch_stream_in_workers

    settings = dict(batch_size=3, text_fraction=0.2, short_tokens=64, context=64, long_fraction=0.0)
    before = set(multiprocessing.active_children())
    stream = batch_stream_in_workers(tiny_tokenizer, 5, 2, **settings)
    received = [next(stream) for _ in range(6)]
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2
    stream.close()
    assert not any(w.is_alive() for w in workers)
    own = {tuple(tuple(s.prompt + s.completion) for s in batch)
           for seed in (5000, 5001) for batch in itertools.islice(batch_stream(tiny_tokenizer, seed, **settings), 12)}
    for batch in received:
        assert len(batch) == 3 and tuple(tuple(s.prompt + s.completion) for s in batch) in own


def test_family_mix_weights_the_task_families_of_short_and_long_rows(tiny_tokenizer):
    from collections import Counter

    from dualend.train.training import TRAIN_MIX, batch_stream, family_draws

    assert Counter(family_draws(TRAIN_MIX)) == {"math": 2, "lookup": 2, "code": 2}
    for bad in ("math=2,poetry=1", "math=two", "lookup=0"):
        with pytest.raises(ValueError, match="family mix"):
            family_draws(bad)
    settings = dict(batch_size=8, text_fraction=0.0, short_tokens=160, context=640, long_fraction=0.5)
    rows = [row for batch in itertools.islice(batch_stream(tiny_tokenizer, 3, mix="lookup=1", **settings), 30)
            for row in batch]
    text = [tiny_tokenizer.decode(row.prompt) for row in rows]
    # every task row is a lookup (or its context-copy variant): key:value entries, no math or code
    assert all(not t.lstrip().startswith(("Q:", "def ")) and "print(" not in t for t in text)
    assert any("\nget " in t for t in text)
    assert any(len(row.prompt) > 160 for row in rows)  # long rows drawn from the same mix


def test_a_run_that_spent_its_time_limit_is_saved_and_left_alone_when_run_again(tmp_path, tiny_tokenizer):
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer.to_json(), encoding="utf-8")
    command = ["baseline", "--tokenizer", str(tmp_path / "tokenizer.json"), "--run", str(tmp_path / "run"),
               "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--batch-size", "2", "--max-tokens", "48",
               "--context", "256", "--steps", "1000", "--eval-every", "1000", "--eval-examples", "1",
               "--time-limit-minutes", "0.0001"]
    train_main(command)
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert state["step"] < 1000 and (tmp_path / "run" / "best").exists()
    recipe = load_checkpoint(tmp_path / "run" / "best").recipe
    assert recipe["steps"] == state["step"] and recipe["planned_steps"] == 1000
    train_main(command)
    again = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert again["step"] == state["step"] and again["stale"] == state["stale"]
