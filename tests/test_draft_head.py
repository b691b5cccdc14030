"""Verified drafts: a token-level model with a draft head gives exactly the base's output."""
import json

import numpy as np
import pytest
import torch

from builder.export import export_checkpoint
from conftest import tiny_model
from dualend.engine.checkpoint import Checkpoint
from dualend.engine.model import ModelConfig
from dualend.engine.decode import CapacityError, DraftPacer, SamplingParams, SequenceDecoder, VerifyingDecoder
from dualend.engine.onnx_engine import OnnxComponents
from dualend.serving.offline import generate_text
from dualend.train import draft_head
from dualend.train.conversion import teacher_hidden

PAD, EOS, BOS, V = 0, 2, 1, 8


def logits_for(token: int, margin: float = 5.0) -> np.ndarray:
    logits = np.zeros(V, np.float32)
    logits[token] = margin
    return logits


def test_a_kept_draft_gives_two_tokens_and_a_wrong_one_is_replaced_by_the_bases_and_dropped():
    decoder = VerifyingDecoder(PAD, EOS, BOS, SamplingParams(max_tokens=10), threshold=0.0, prompt_tokens=4)
    assert decoder.settle(logits_for(5)) == [5] and not decoder.checked
    assert decoder.drafts_after([5])
    tokens, hidden, positions = decoder.mtp_inputs([5], np.ones(3), None)
    assert tokens == [5] and hidden.shape == (1, 3) and positions.tolist() == [3]
    step = decoder.finish([5], logits_for(6), 0.9)
    assert step.tokens == [5] and decoder.next_pair == [5, 6]

    # the base at the token fed (verify_logits) agrees with the draft 6: kept, and 7 follows from 6's position
    assert decoder.settle(logits_for(7), logits_for(6)) == [6, 7] and decoder.kept and decoder.discard == 0
    _, hidden, positions = decoder.mtp_inputs([6, 7], np.full(3, 2.0), np.full(3, 1.0))
    assert hidden[:, 0].tolist() == [1.0, 2.0] and positions.tolist() == [4, 5]
    step = decoder.finish([6, 7], logits_for(3), 0.9)
    assert step.tokens == [6, 7] and step.drafted and step.accepted and decoder.next_pair == [7, 3]

    # the base says 4 where the draft said 3: 4 is the output, the draft's slot is dropped
    assert decoder.settle(logits_for(5), logits_for(4)) == [4] and decoder.discard == 1 and not decoder.kept
    _, hidden, positions = decoder.mtp_inputs([4], np.full(3, 2.0), np.full(3, 1.0))
    assert hidden[:, 0].tolist() == [1.0] and positions.tolist() == [6]
    step = decoder.finish([4], None)
    assert step.tokens == [4] and step.drafted and not step.accepted and decoder.next_pair == [4]
    assert decoder.produced == 4


def test_a_draft_below_the_threshold_is_not_fed_and_none_is_near_max_tokens_or_after_eos():
    decoder = VerifyingDecoder(PAD, EOS, BOS, SamplingParams(max_tokens=3), threshold=0.5, prompt_tokens=2)
    decoder.settle(logits_for(5))
    decoder.finish([5], logits_for(6), confidence=0.4)
    assert decoder.next_pair == [5] and decoder.draft is None
    assert decoder.drafts_after([6]) is False  # 1 produced + 1 + a draft and its next > 3
    assert not decoder.drafts_after([EOS])
    step = decoder.finish([6, EOS])
    assert step.tokens == [6] and step.finish_reason == "eos"
    off = VerifyingDecoder(PAD, EOS, BOS, SamplingParams(max_tokens=30), threshold=1.0, prompt_tokens=2)
    assert not off.drafts_after([5])


def test_a_kept_draft_past_max_tokens_is_cut_there():
    decoder = VerifyingDecoder(PAD, EOS, BOS, SamplingParams(max_tokens=2), threshold=0.0, prompt_tokens=2)
    decoder.settle(logits_for(5))
    decoder.finish([5], logits_for(6), 0.9)
    step = decoder.finish(decoder.settle(logits_for(7), logits_for(6)))
    assert step.tokens == [6] and step.finish_reason == "length"


def test_speculative_sampling_draws_the_first_token_from_the_bases_distribution_whatever_the_draft():
    p_logits = np.log(np.array([1e-9, 1e-9, 1e-9, 0.5, 0.3, 0.2, 1e-9, 1e-9], np.float64)).astype(np.float32)
    q_logits = np.log(np.array([1e-9, 1e-9, 1e-9, 0.1, 0.2, 0.7, 1e-9, 1e-9], np.float64)).astype(np.float32)
    counts = np.zeros(V)
    for seed in range(4000):
        decoder = VerifyingDecoder(PAD, EOS, BOS, SamplingParams(max_tokens=10, temperature=1.0, seed=seed),
                                   threshold=0.0, prompt_tokens=2)
        decoder.settle(logits_for(3))
        decoder.finish([3], q_logits, 0.9)  # the draft drawn from q
        counts[decoder.settle(p_logits, p_logits)[0]] += 1
    np.testing.assert_allclose(counts[3:6] / counts.sum(), [0.5, 0.3, 0.2], atol=0.03)


@pytest.fixture(scope="module")
def base_and_head(tiny_tokenizer, tmp_path_factory):
    """A tiny base, exported alone and with a draft head trained for a moment on its own greedy text."""
    root = tmp_path_factory.mktemp("draft_head")
    base = Checkpoint(tiny_model(tiny_tokenizer, 1, seed=3), tiny_tokenizer)
    export_checkpoint(base, root / "base")
    prompts = ["Q: 3+4\nA:", " ab:12 cd:34\nget cd:", "def f(x):\n", "Q: 9-2\nA:"]
    engine = OnnxComponents(root / "base")
    texts = [p + generate_text(engine, tiny_tokenizer, p, SamplingParams(max_tokens=48, ignore_eos=True), 1.0).text
             for p in prompts]
    rows = [tiny_tokenizer.encode(t) for t in texts]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [tiny_tokenizer.pad_id] * (width - len(r)) for r in rows])
    valid = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    start = torch.tensor([len(tiny_tokenizer.encode(p)) - 1 for p in prompts])
    torch.manual_seed(0)
    model = draft_head.with_draft_head(base.model)
    random_head = draft_head.with_draft_head(base.model)
    with torch.no_grad():
        for weight in random_head.mtp.parameters():
            weight.normal_(0.0, 0.5)
    draft_head.write_head(random_head, base.id, {"steps": 0}, root / "untrained_head")
    export_checkpoint(draft_head.checkpoint_with_head(base, root / "untrained_head"), root / "untrained")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(150):
        loss, figures = draft_head.draft_loss(model, tokens, valid, start)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft_head.write_head(model, base.id, {"steps": 150}, root / "head")
    with_head = draft_head.checkpoint_with_head(base, root / "head")
    export_checkpoint(with_head, root / "with_head")
    export_checkpoint(base, root / "base_w8a8", weight_precision="w8a8")
    export_checkpoint(with_head, root / "with_head_w8a8", weight_precision="w8a8")
    ids = draft_head.frequent_tokens(rows, 16, always=[tiny_tokenizer.eos_id])
    draft_head.write_head(draft_head.restricted(model, ids), base.id, {"steps": 150}, root / "narrow_head",
                          dtype=torch.bfloat16)
    export_checkpoint(draft_head.checkpoint_with_head(base, root / "narrow_head"), root / "narrow")
    return root, prompts, figures["top1"]


@pytest.mark.parametrize("head", ["with_head", "untrained", "narrow"])
def test_greedy_output_with_verified_drafts_is_the_bases_token_for_token(base_and_head, tiny_tokenizer, head):
    root, prompts, trained_top1 = base_and_head
    assert trained_top1 > 0.5  # the trained head learnt the base's text: its drafts are kept
    base, with_head = OnnxComponents(root / "base"), OnnxComponents(root / head)
    kept = drafted = 0
    for prompt in prompts + ["Q: 1+1\nA:", "get ab:"]:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        expected = generate_text(base, tiny_tokenizer, prompt, params, 1.0)
        got = generate_text(with_head, tiny_tokenizer, prompt, params, 0.0)
        assert got.tokens == expected.tokens and got.text == expected.text
        assert got.steps == expected.steps - got.accepted
        kept, drafted = kept + got.accepted, drafted + got.drafts
    if head in ("with_head", "narrow"):
        assert drafted > 0 and kept > drafted / 2
    else:  # an untrained head's drafts are mostly wrong: each is dropped, the output is still the base's
        assert drafted > 0 and kept < drafted / 2


def test_w8a8_verified_drafts_are_the_w8a8_bases_text_token_for_token_alone_and_side_by_side(base_and_head, tiny_tokenizer):
    """8-bit products are integer and each row's activations are quantized alone, so a step verifying a
    draft computes what one-latent steps compute, bit for bit: no near-tie of the base's flips."""
    root, prompts, _ = base_and_head
    base, with_head = OnnxComponents(root / "base_w8a8"), OnnxComponents(root / "with_head_w8a8")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [generate_text(base, tiny_tokenizer, prompt, params, 1.0).tokens for prompt in prompts]
    alone = [generate_text(with_head, tiny_tokenizer, prompt, params, 0.0) for prompt in prompts]
    assert [got.tokens for got in alone] == expected and sum(got.accepted for got in alone) > 0
    together = run_together(OnnxComponents(root / "with_head_w8a8"), tiny_tokenizer, prompts, params, 0.0)
    assert [tokens for tokens, _ in together] == expected


def test_a_narrowed_head_drafts_only_its_frequent_tokens_and_ships_them(base_and_head, tiny_tokenizer):
    root, prompts, _ = base_and_head
    narrowed = draft_head.checkpoint_with_head(
        Checkpoint(tiny_model(tiny_tokenizer, 1, seed=3), tiny_tokenizer), root / "narrow_head").model
    ids = narrowed.mtp.draft_ids
    assert narrowed.cfg.draft_vocab == len(ids) == 16 and tiny_tokenizer.eos_id in ids.tolist()
    engine = OnnxComponents(root / "narrow")
    session = engine.open_mtp(4)
    logits, confidence = session.step(1, np.ones(narrowed.cfg.d_model, np.float32), 0)
    session.close()
    assert set(np.flatnonzero(np.isfinite(logits)).tolist()) == set(ids.tolist()) and 0 < confidence <= 1


def test_the_most_frequent_tokens_are_the_draft_vocabulary():
    assert draft_head.frequent_tokens([[5, 5, 7, 9], [7, 5, 3]], 2).tolist() == [5, 7]
    assert draft_head.frequent_tokens([[5, 5, 7, 9], [7, 5, 3]], 2, always=[3]).tolist() == [3, 5]


def test_drafting_off_decodes_one_token_a_step(base_and_head, tiny_tokenizer):
    root, prompts, _ = base_and_head
    got = generate_text(OnnxComponents(root / "with_head"), tiny_tokenizer, prompts[0],
                        SamplingParams(max_tokens=20, ignore_eos=True), 1.0)
    assert got.drafts == 0 and got.steps == 20


def test_a_head_for_another_base_is_refused(base_and_head, tiny_tokenizer):
    root, _, _ = base_and_head
    other = Checkpoint(tiny_model(tiny_tokenizer, 1, seed=4), tiny_tokenizer)
    with pytest.raises(ValueError, match="draft head for base"):
        draft_head.checkpoint_with_head(other, root / "head")


def run_together(engine, tokenizer, prompts, params, threshold, draft_max_batch=0):
    """The prompts decoded in one loop, side by side: their generations, in order."""
    from dualend.serving.contract import PreparedRequest
    from dualend.serving.offline import _Collected, decode_loop

    loop = decode_loop(engine, tokenizer, threshold)
    loop.draft_max_batch = draft_max_batch
    outputs = []
    for request_id, prompt in enumerate(prompts, 1):
        own = params[request_id - 1] if isinstance(params, list) else params
        request = PreparedRequest(tokenizer.encode_prompt(prompt), own, stream=True, exclude_input_in_output=True)
        outputs.append(_Collected())
        loop.submit(request_id, request, engine.compress(request.prompt_pairs(1, engine.pad_id)), outputs[-1])
    while loop.run_once():
        pass
    assert all(o.done and o.error is None for o in outputs)
    return [([t for r in o.responses for t in r.output_ids], sum(r.counters["num_drafts"] for r in o.responses))
            for o in outputs]


@pytest.mark.parametrize("head", ["with_head", "untrained"])
def test_sequences_verified_side_by_side_each_get_the_bases_text(base_and_head, tiny_tokenizer, head):
    """Rows feeding two tokens and rows feeding one in the same iterations (kept and dropped drafts mixed)."""
    root, prompts, _ = base_and_head
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = [generate_text(OnnxComponents(root / "base"), tiny_tokenizer, p, params, 1.0).tokens for p in prompts]
    together = run_together(OnnxComponents(root / head), tiny_tokenizer, prompts, params, 0.0)
    assert [tokens for tokens, _ in together] == expected
    assert all(drafts > 0 for _, drafts in together)


def test_no_draft_is_fed_while_more_sequences_decode_than_draft_max_batch(base_and_head, tiny_tokenizer):
    root, prompts, _ = base_and_head
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [generate_text(OnnxComponents(root / "base"), tiny_tokenizer, p, params, 1.0).tokens
                for p in prompts[:2]]
    together = run_together(OnnxComponents(root / "with_head"), tiny_tokenizer, prompts[:2], params, 0.0,
                            draft_max_batch=1)
    assert together == [(tokens, 0) for tokens in expected]  # both decode every step together: no draft
    # once the short one ends the long one drafts again, from a fresh MTP cache: still the base's text
    short, long = SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)
    together = run_together(OnnxComponents(root / "with_head"), tiny_tokenizer, prompts[:2], [short, long], 0.0,
                            draft_max_batch=1)
    assert together[1][0] == generate_text(OnnxComponents(root / "base"), tiny_tokenizer, prompts[1], long, 1.0).tokens
    assert together[0][1] == 0 and together[1][1] > 0


def test_the_pacer_pauses_a_sequence_whose_drafts_are_not_kept_longer_each_time_and_resumes():
    pacer = DraftPacer(0.3, window=8, start=0.5, pause=4, max_pause=8)
    rejected_until_paused = 0
    while pacer.may_draft():
        pacer.record(False)
        rejected_until_paused += 1
    # 0.5 * (7/8)^n < 0.3 from n = 4 on: a few misses, not one, pause it
    assert rejected_until_paused == 4 and pacer.pauses == 1
    assert [pacer.may_draft() for _ in range(4)] == [False, False, False, True]  # the rejected step's pause, then 3
    for _ in range(4):
        pacer.record(False)
    assert sum(not pacer.may_draft() for _ in range(20)) == 8  # twice as long, at most max_pause
    for _ in range(4):
        pacer.record(False)
    assert sum(not pacer.may_draft() for _ in range(20)) == 8
    for _ in range(12):
        pacer.record(True)
    assert pacer.next_pause == 4  # kept drafts again: the next pause is short again


def test_a_pacer_with_no_floor_never_pauses_and_a_floor_must_be_below_the_start():
    pacer = DraftPacer(0.0)
    for _ in range(100):
        pacer.record(False)
    assert pacer.may_draft() and pacer.pauses == 0
    with pytest.raises(ValueError, match="min_acceptance 0.6: a share in"):
        DraftPacer(0.6)


@pytest.mark.parametrize("head", ["with_head", "untrained"])
def test_paced_drafts_still_give_the_bases_text_and_an_untrained_head_mostly_stops_drafting(
        base_and_head, tiny_tokenizer, head):
    """With pacing (min acceptance 0.3) the output is still the base's token for token; a head whose
    drafts are mostly dropped pauses (fewer drafts than steps without pacing), a good one keeps drafting."""
    root, prompts, _ = base_and_head
    base, with_head = OnnxComponents(root / "base"), OnnxComponents(root / head)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    paced_drafts = unpaced_drafts = 0
    for prompt in prompts:
        expected = generate_text(base, tiny_tokenizer, prompt, params, 1.0)
        unpaced = generate_text(with_head, tiny_tokenizer, prompt, params, 0.0)
        paced = generate_text(with_head, tiny_tokenizer, prompt, params, 0.0, draft_min_acceptance=0.3)
        assert paced.tokens == expected.tokens == unpaced.tokens
        assert paced.steps == expected.steps - paced.accepted
        paced_drafts, unpaced_drafts = paced_drafts + paced.drafts, unpaced_drafts + unpaced.drafts
    if head == "untrained":
        assert paced_drafts < unpaced_drafts / 2
    else:
        assert paced_drafts > 0.8 * unpaced_drafts


def test_a_pair_model_whose_gate_rejects_its_drafts_stops_calling_the_head_for_a_while():
    decoder = SequenceDecoder(2, pad_id=0, eos_id=1, bos_id=2, params=SamplingParams(max_tokens=100),
                              threshold=0.5, prompt_pairs=3, min_acceptance=0.3)
    logits = np.zeros(8, np.float32)
    logits[5] = 10.0
    asked = []
    for _ in range(12):
        asked.append(decoder.drafts_after([5]))
        step = decoder.finish([5], logits if asked[-1] else None, confidence=0.1)  # below the gate: PAD
        assert step.tokens == [5] and decoder.next_pair == [5, 0]
    assert asked[:4] == [True] * 4 and not any(asked[4:12])  # paused from the fifth step, for 8


def varied_base(tokenizer):
    """An untrained tiny model repeats one token with little confidence; this one's greedy text
    varies, and its distributions are sharp."""
    model = tiny_model(tokenizer, 1, seed=3)
    with torch.no_grad():
        for weight in model.backbone.parameters():
            weight.mul_(4 if weight.dim() == 2 else 1)
        model.backbone.norm.weight.mul_(100)
    return model


def test_teacher_records_hold_the_bases_greedy_tokens_and_the_hidden_states_that_chose_them(tiny_tokenizer):
    base = varied_base(tiny_tokenizer)
    prompts = [tiny_tokenizer.encode_prompt(p) for p in ("Q: 3+4\nA:", "def f(x):\n", "get ab:")]
    free = [r["tokens"].tolist() for r in draft_head.teacher_records(base, prompts, 12)]
    # a token the second row makes after a first one, made the end of text: rows stop at it, or go on
    eos = next(t for t in free[1][1:] if t != free[1][0])
    base.cfg = ModelConfig(**(base.cfg.to_dict() | {"eos_id": eos}))
    records = draft_head.teacher_records(base, prompts, 12)
    lengths = [len(r["tokens"]) for r in records]
    assert lengths == [t.index(eos) + 1 if eos in t else 12 for t in free] and len(set(lengths)) > 1
    for prompt, record in zip(prompts, records):
        tokens = record["tokens"].tolist()
        assert 1 <= len(tokens) <= 12 and (len(tokens) == 12 or tokens[-1] == base.cfg.eos_id)
        assert base.cfg.eos_id not in tokens[:-1] and record["position"] == len(prompt) - 1
        assert base.cfg.pad_id not in tokens and base.cfg.bos_id not in tokens
        with torch.no_grad():  # the same text teacher-forced in one pass, each row alone
            hidden = teacher_hidden(base, torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
            logits = base.lm_head(hidden)
        logits[:, [base.cfg.pad_id, base.cfg.bos_id]] = float("-inf")  # as served: never chosen
        assert logits.argmax(-1).tolist() == tokens
        torch.testing.assert_close(record["hidden"].float(), hidden, atol=2e-2, rtol=1e-2)


def test_sampled_teacher_records_are_drawn_from_the_bases_distribution_and_repeat_with_their_seed(tiny_tokenizer):
    base = varied_base(tiny_tokenizer)
    prompts = [tiny_tokenizer.encode_prompt(p) for p in ("Q: 3+4\nA:", "def f(x):\n", "get ab:")] * 4
    greedy = [r["tokens"].tolist() for r in draft_head.teacher_records(base, prompts, 10)]
    sampled = draft_head.teacher_records(base, prompts, 10, temperature=1.5, seed=7)
    again = draft_head.teacher_records(base, prompts, 10, temperature=1.5, seed=7)
    assert [r["tokens"].tolist() for r in sampled] == [r["tokens"].tolist() for r in again]
    assert [r["tokens"].tolist() for r in sampled] != greedy
    assert len({tuple(r["tokens"].tolist()) for r in sampled}) > 3  # one prompt, several continuations
    for prompt, record in zip(prompts, sampled):
        tokens = record["tokens"].tolist()
        assert base.cfg.pad_id not in tokens and base.cfg.bos_id not in tokens
        with torch.no_grad():  # each hidden state is the one the sampled text leads to
            hidden = teacher_hidden(base, torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
        torch.testing.assert_close(record["hidden"].float(), hidden, atol=2e-2, rtol=1e-2)
    cold = draft_head.teacher_records(base, prompts, 10, temperature=1e-4, seed=7)
    assert [r["tokens"].tolist() for r in cold] == greedy


def test_sampled_first_tokens_follow_the_bases_distribution_at_the_temperature(tiny_tokenizer):
    base = varied_base(tiny_tokenizer)
    prompt = tiny_tokenizer.encode_prompt("def f(x):\n")
    assert base.cfg.pad_id not in prompt and base.cfg.tie_embeddings
    temperature = 3.0
    with torch.no_grad():
        hidden = teacher_hidden(base, torch.tensor([prompt]))[0, -1]
        top = base.lm_head(hidden).max()  # PAD made the likeliest token here: only the mask keeps it out
        base.embedding.weight[base.cfg.pad_id] = hidden * (top + temperature) / hidden.square().sum()
        logits = base.lm_head(teacher_hidden(base, torch.tensor([prompt]))[0, -1]).double()
    assert (logits / temperature).softmax(-1)[base.cfg.pad_id] > 0.2
    logits[[base.cfg.pad_id, base.cfg.bos_id]] = float("-inf")
    expected = (logits / temperature).softmax(-1)
    assert expected.max() < 0.8  # a spread the draws can show
    records = draft_head.teacher_records(base, [prompt] * 600, 1, temperature=temperature, seed=3)
    seen = torch.bincount(torch.tensor([r["tokens"][0].item() for r in records]), minlength=len(expected)) / 600
    assert (seen - expected).abs().sum() / 2 < 0.1  # total variation, ~0.03 expected from 600 draws


def test_the_loss_on_records_is_the_loss_with_the_base_run_on_the_same_text(tiny_tokenizer):
    """The two ways of training a head see the same positions and targets: recorded hidden states
    (draft-head --records) and the base run on the batch (draft_loss)."""
    base = varied_base(tiny_tokenizer)
    torch.manual_seed(1)
    model = draft_head.with_draft_head(base)
    prompts = [tiny_tokenizer.encode_prompt(p) for p in ("Q: 3+4\nA:", "def f(x):\n")]
    records = draft_head.teacher_records(base, prompts, 16)
    rows = [p + r["tokens"].tolist() for p, r in zip(prompts, records)]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [tiny_tokenizer.pad_id] * (width - len(r)) for r in rows])
    valid = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    start = torch.tensor([len(p) - 1 for p in prompts])
    with torch.no_grad():
        expected_kl, expected = draft_head.draft_loss(model, tokens, valid, start)
        kl, got = draft_head.record_loss(model, draft_head.record_rows(records), torch.arange(base.cfg.vocab_size))
    assert got["positions"] == expected["positions"] == sum(len(r["tokens"]) - 1 for r in records) > 10
    assert got["top1"] == pytest.approx(expected["top1"])
    assert kl.item() == pytest.approx(expected_kl.item(), rel=2e-2)
    ids = draft_head.frequent_tokens([r["tokens"] for r in records], 4)
    with torch.no_grad():  # over the draft tokens only: both distributions renormalised over them
        narrow_kl, narrow = draft_head.record_loss(model, draft_head.record_rows(records), ids)
        positions = torch.arange(width - 1)[None].expand(2, -1)
        head_logits, _, _, _ = model.mtp_forward(tokens[:, 1:], teacher_hidden(base, tokens)[:, :-1], positions,
                                                 valid[:, 1:] & (positions >= start[:, None]))  # as served
        base_logits = base.lm_head(teacher_hidden(base, tokens))[:, 1:]
    scored = torch.zeros_like(valid[:, 1:])
    for row, (prompt, record) in enumerate(zip(prompts, records)):
        scored[row, len(prompt) - 1:len(prompt) + len(record["tokens"]) - 2] = True
    p, q = base_logits[scored][:, ids].log_softmax(-1), head_logits[scored][:, ids].log_softmax(-1)
    assert narrow_kl.item() == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=2e-2)
    drafted = ids[head_logits[scored][:, ids].argmax(-1)]
    assert narrow["top1"] == pytest.approx((drafted == base_logits[scored].argmax(-1)).float().mean().item())
    # --greedy-weight: the head's cross-entropy against the base's top token added to the KL, which the
    # figures still report alone; both ways of training take it alike
    with torch.no_grad():
        weighted, figures = draft_head.record_loss(model, draft_head.record_rows(records), ids, greedy_weight=0.5)
        weighted_on_base_run, _ = draft_head.draft_loss(model, tokens, valid, start, greedy_weight=0.5)
        wide_weighted, _ = draft_head.record_loss(model, draft_head.record_rows(records),
                                                  torch.arange(base.cfg.vocab_size), greedy_weight=0.5)
    head_ids = head_logits[scored][:, ids]
    cross_entropy = -head_ids.log_softmax(-1)[torch.arange(len(head_ids)), base_logits[scored][:, ids].argmax(-1)]
    assert weighted.item() == pytest.approx(narrow_kl.item() + 0.5 * cross_entropy.mean().item(), rel=2e-2)
    assert figures["kl"] == pytest.approx(narrow["kl"]) and figures["top1"] == narrow["top1"]
    assert cross_entropy.mean().item() > 0.1  # the untrained head's drafts are not yet the base's: the term counts
    assert wide_weighted.item() == pytest.approx(weighted_on_base_run.item(), rel=2e-2)


def test_records_from_an_export_are_what_its_engine_chooses(tiny_tokenizer, tmp_path, monkeypatch, exported):
    """draft-head-records --engine: the export's continuations on ONNX Runtime (the served engine), the
    same text and hidden states as the torch base for an fp32 export; the folder says which engine."""
    from builder import train
    base = Checkpoint(varied_base(tiny_tokenizer), tiny_tokenizer)
    base.save(tmp_path / "base")
    export_checkpoint(base, tmp_path / "export")
    engine = OnnxComponents(tmp_path / "export", max_sequences=4)
    prompts = [tiny_tokenizer.encode_prompt(p) for p in ("Q: 3+4\nA:", "def f(x):\n", "get ab:")]
    on_torch = draft_head.teacher_records(base.model, prompts, 12)
    on_engine = draft_head.teacher_records(engine, prompts, 12)
    assert [r["tokens"].tolist() for r in on_engine] == [r["tokens"].tolist() for r in on_torch]
    assert len({tuple(r["tokens"].tolist()) for r in on_torch}) == 3  # three different continuations
    for mine, reference in zip(on_engine, on_torch):
        assert mine["position"] == reference["position"]
        torch.testing.assert_close(mine["hidden"].float(), reference["hidden"].float(), atol=2e-2, rtol=1e-2)
    assert not engine.backbone.cache.sequences  # every row given back
    with pytest.raises(CapacityError, match="all 4 sequence rows are taken"):  # at the fifth prompt's prefill
        draft_head.teacher_records(engine, prompts * 2, 12)
    assert not engine.backbone.cache.sequences  # the four it held given back
    with pytest.raises(ValueError, match="token-level"):
        draft_head.teacher_records(OnnxComponents(exported["dualend"][1]), prompts, 4)

    monkeypatch.setattr(train, "open_prompts", lambda split, seed: [f"Q: {i}+{split == 'train'}\nA:" for i in range(4)])
    command = ["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "records"),
               "--open", "4", "--task", "0", "--text", "0", "--held-out-open", "2", "--held-out-task", "0",
               "--held-out-text", "0", "--max-tokens", "8", "--rows", "4"]
    train.main(command + ["--engine", str(tmp_path / "export")])
    assert json.loads((tmp_path / "records" / "records.json").read_text())["engine"] == {
        "runtime": "onnxruntime", "weight_precision": "fp32"}
    assert sorted(p.name for p in (tmp_path / "records").glob("*.pt")) == ["held_out.pt", "train_0000.pt"]
    with pytest.raises(SystemExit, match="made otherwise"):
        train.main(command)  # the torch model would resume another engine's folder
    with pytest.raises(SystemExit, match="not of the --baseline"):
        train.main(command[:-2] + ["--out", str(tmp_path / "other"), "--engine", str(exported["baseline"][1])])


def test_records_from_the_nth_open_request_are_those_an_earlier_folder_of_n_lacks(tiny_tokenizer, monkeypatch):
    from builder import train
    monkeypatch.setattr(train, "open_prompts", lambda split, seed: [f"Q: {i}+{i}\nA:" for i in range(9)])
    counts = {"open": 9, "task": 0, "text": 2}
    every = train.record_prompts(tiny_tokenizer, "train", counts, 12, seed=0)
    earlier = train.record_prompts(tiny_tokenizer, "train", {**counts, "open": 6}, 12, seed=0)
    rest = train.record_prompts(tiny_tokenizer, "train", {**counts, "text": 0}, 12, seed=0, open_from=6)
    assert len(rest) == 3 and sorted(earlier + rest) == sorted(every)


def test_no_topic_is_in_two_editions_or_twice_in_one():
    """A repeated topic would repeat its requests in every list (and weigh them double in training)."""
    from dualend.train.open_prompts import TOPIC_EDITIONS
    topics = [topic.lower() for edition in TOPIC_EDITIONS for kind in edition.values() for topic in kind]
    assert len(topics) == len(set(topics)), sorted(t for t in set(topics) if topics.count(t) > 1)


def test_topics_added_in_a_new_edition_come_after_every_earlier_request(monkeypatch):
    from dualend.train import open_prompts as module
    before = {split: module.open_prompts(split, seed=3) for split in ("train", "held_out")}
    edition = {"food": ("poutine", "pierogi", "tamales", "arepas", "khachapuri", "injera"),
               "animal": ("axolotls", "capybaras", "pangolins", "tapirs", "okapis", "quokkas", "fossas")}
    new_topics = [topic for topics in edition.values() for topic in topics]
    assert not set(new_topics) & {topic for topics in module.TOPICS.values() for topic in topics}
    monkeypatch.setattr(module, "TOPIC_EDITIONS", module.TOPIC_EDITIONS + (edition,))
    added = 0
    for split, earlier in before.items():
        after = module.open_prompts(split, seed=3)
        assert after[:len(earlier)] == earlier
        assert all(sum(topic in request for topic in new_topics) == 1 for request in after[len(earlier):])
        added += len(after) - len(earlier)
    assert added == sum(len(module.TEMPLATES[kind]) * len(topics) for kind, topics in edition.items())


def test_a_head_trained_from_records_learns_the_bases_held_out_continuations(tiny_tokenizer, tmp_path, monkeypatch):
    """draft-head-records then draft-head --records, as a user runs them, on a tiny base."""
    from builder import train
    base = Checkpoint(varied_base(tiny_tokenizer), tiny_tokenizer)
    base.save(tmp_path / "base")
    monkeypatch.setattr(train, "open_prompts", lambda split, seed: [f"Q: {i}+{split == 'train'}\nA:" for i in range(9)])
    train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "records"),
                "--open", "9", "--task", "0", "--text", "6", "--held-out-open", "3", "--held-out-task", "0",
                "--held-out-text", "3", "--max-tokens", "24", "--text-tokens", "12", "--rows", "5"])
    assert sorted(p.name for p in (tmp_path / "records").glob("*.pt")) == [
        "held_out.pt", "train_0000.pt", "train_0001.pt", "train_0002.pt"]
    meta = json.loads((tmp_path / "records" / "records.json").read_text())
    (tmp_path / "records" / "records.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "temperature"}))
    train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "records"),
                "--open", "9", "--task", "0", "--text", "6", "--held-out-open", "3", "--held-out-task", "0",
                "--held-out-text", "3", "--max-tokens", "24", "--text-tokens", "12", "--rows", "5"])  # resumed: greedy
    with pytest.raises(SystemExit, match="made otherwise"):
        train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "records"),
                    "--open", "9", "--task", "0", "--text", "6", "--held-out-open", "3", "--held-out-task", "0",
                    "--held-out-text", "3", "--max-tokens", "24", "--text-tokens", "12", "--rows", "5",
                    "--temperature", "0.5"])
    train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "sampled"),
                "--open", "9", "--task", "0", "--text", "0", "--held-out-open", "0", "--held-out-task", "0",
                "--held-out-text", "0", "--max-tokens", "24", "--rows", "5", "--temperature", "1.0"])
    assert sorted(p.name for p in (tmp_path / "sampled").glob("*.pt")) == ["train_0000.pt", "train_0001.pt"]
    train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "hot"),
                "--open", "0", "--task", "0", "--text", "0", "--held-out-open", "3", "--held-out-task", "0",
                "--held-out-text", "3", "--max-tokens", "24", "--text-tokens", "12", "--temperature", "2.0"])
    held_out = [torch.load(tmp_path / folder / "held_out.pt", weights_only=True) for folder in ("records", "hot")]
    assert [r["tokens"].tolist() for r in held_out[1]] == [r["tokens"].tolist() for r in held_out[0]]  # greedy
    with pytest.raises(SystemExit, match="no held-out shard"):
        train.main(["draft-head", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "unscored"),
                    "--records", str(tmp_path / "sampled"), str(tmp_path / "records"), "--steps", "1"])
    with pytest.raises(SystemExit, match="finite number >= 0"):
        train.main(["draft-head-records", "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "bad"),
                    "--temperature", "-1"])
    torch.manual_seed(0)
    scrambled = draft_head.with_draft_head(base.model)  # a head far from the base: what it learns shows
    with torch.no_grad():
        for weight in scrambled.mtp.parameters():
            weight.normal_(0.0, 0.5)
    draft_head.write_head(scrambled, base.id, {"steps": 0}, tmp_path / "scrambled")
    train.main(["draft-head", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"),
                "--init-head", str(tmp_path / "scrambled"),
                "--records", str(tmp_path / "records"), str(tmp_path / "sampled"), "--time-limit-minutes", "0", "--steps", "400", "--eval-every", "1000",
                "--batch-size", "4", "--lr", "1e-2", "--warmup", "1", "--draft-vocab", "0",
                "--ship-to", str(tmp_path / "shipped")])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [0, 400]
    assert log[0]["records_kl"] > 1.0 and log[0]["records_top1"] < 0.1
    assert log[-1]["records_kl"] < 0.8 * log[0]["records_kl"] and log[-1]["records_top1"] > 0.3
    shipped = draft_head.checkpoint_with_head(base, tmp_path / "shipped")
    assert shipped.recipe["draft_head"]["records"] == [str(tmp_path / "records"), str(tmp_path / "sampled")]
    assert shipped.recipe["draft_head"]["records_continuations"] == 9 + 6 + 9
    train.main(["draft-head", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"),
                "--init-head", str(tmp_path / "scrambled"), "--records", str(tmp_path / "records"),
                "--time-limit-minutes", "0", "--steps", "410", "--eval-every", "1000", "--batch-size", "4",
                "--lr", "1e-3", "--warmup", "1", "--draft-vocab", "0", "--ship-to", str(tmp_path / "shipped")])
    recipe = draft_head.checkpoint_with_head(base, tmp_path / "shipped").recipe["draft_head"]
    first, second = recipe["invocations"]  # a resumed run's recipe keeps each invocation's arguments
    assert (first["from_step"], first["to_step"], first["lr"], first["init_head"]) == (0, 400, 1e-2, str(tmp_path / "scrambled"))
    assert first["records"] == [str(tmp_path / "records"), str(tmp_path / "sampled")]
    assert (second["from_step"], second["to_step"], second["lr"], second["init_head"]) == (400, 410, 1e-3, None)
    assert second["records"] == [str(tmp_path / "records")] and recipe["lr"] == 1e-3 and recipe["steps"] == 410
    assert recipe["started_from"] == {"steps": 0}  # the scrambled head's recipe, kept through the resume
    # a head that drafts from a vocabulary of its own goes on drafting from it, whatever --draft-vocab says
    own_ids = torch.tensor(sorted({*range(5, 13), tiny_tokenizer.eos_id}))
    draft_head.write_head(draft_head.restricted(scrambled, own_ids), base.id, {"steps": 0}, tmp_path / "narrow")
    train.main(["draft-head", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "narrow_run"),
                "--init-head", str(tmp_path / "narrow"), "--records", str(tmp_path / "records"),
                "--time-limit-minutes", "0", "--steps", "2", "--eval-every", "1000", "--batch-size", "4",
                "--draft-vocab", "4", "--ship-to", str(tmp_path / "narrow_shipped")])
    shipped = draft_head.checkpoint_with_head(base, tmp_path / "narrow_shipped").model
    assert shipped.mtp.draft_ids.tolist() == own_ids.tolist()
