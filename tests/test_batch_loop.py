"""The batched decode loop without a server: the scheduler's decisions on hand-built cases, and
the loop on the exported tiny models against the step-by-step reference (`reference_generate`)."""
import threading
import time

import numpy as np
import pytest

from dualend.engine.decode import CapacityError, InvalidRequest, SamplingParams, pad_prompt
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.reference import reference_text
from dualend.engine.scheduler import Scheduler
from dualend.serving.contract import PreparedRequest, Response
from dualend.serving.loop import DecodeLoop, Executor, QueuedOutput, SendThread
from dualend.serving.outcomes import Outcome

PROMPTS = ["Q: 1+2+3\nA:", "get ab\nA:", "def f(x):\n    return x + 1\nprint(f(2))\n# output:",
           "Q: 4*5-6\nA:", "x = 3\ny = x * 2\nprint(y)\n# output:"]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Seq:
    def __init__(self, num_latents, max_tokens=8, client=""):
        self.num_latents, self.reserve_slots, self.prefilled = num_latents, num_latents + max_tokens, 0
        self.client = client


def decoding_seqs(s, client, count):
    found = [Seq(2, client=client) for _ in range(count)]
    for sequence in found:
        sequence.prefilled = 2
        s.submit(sequence)
    return found


def scheduler(**overrides):
    settings = dict(max_running=2, max_queue=2, wait_s=10.0, prefill_chunk=8, kv_blocks=100, kv_block_size=4,
                    clock=FakeClock())
    settings.update(overrides)
    return Scheduler(**settings)


def test_admission_runs_up_to_the_limit_then_queues_in_arrival_order():
    s = scheduler()
    first, second, third, fourth = (Seq(2) for _ in range(4))
    for sequence in (first, second, third, fourth):
        s.submit(sequence)
    assert s.running == [first, second] and [q for q, _ in s.waiting] == [third, fourth]
    s.finish(first)
    assert s.admit() == ([third], [])


def test_a_full_queue_refuses_saying_so():
    s = scheduler(max_running=1, max_queue=1)
    s.submit(Seq(2))
    s.submit(Seq(2))
    with pytest.raises(CapacityError, match=r"1 requests running and 1 waiting, the queue \(max_queue_size 1\) is full"):
        s.submit(Seq(2))


def test_a_wait_that_runs_out_is_refused_saying_so():
    s = scheduler(max_running=1, wait_s=2.0)
    s.submit(Seq(2))
    late = Seq(2)
    s.submit(late)
    s.clock.now = 2.5
    admitted, expired = s.admit()
    assert not admitted and expired[0][0] is late
    assert "waited 2 s in the queue (queue_wait_s) for a place (1 of 1 taken)" in str(expired[0][1])
    assert late not in s


def test_each_running_sequence_is_charged_its_own_reservation_not_the_widest_rows():
    """One 2,048-token request running (32 blocks of 64) in a 40-block budget: eight short requests
    (a block each) are admitted beside it, as if it took only its own 32; a ninth waits for a place
    in the budget, and gets it when a short one ends."""
    s = scheduler(max_running=16, max_queue=4, kv_blocks=40, kv_block_size=64)
    long_one = Seq(1024, max_tokens=1024)
    s.submit(long_one)
    shorts = [Seq(40, max_tokens=24) for _ in range(9)]
    for sequence in shorts:
        s.submit(sequence)
    assert s.running == [long_one, *shorts[:8]] and s.used_blocks == 40
    assert [waiting for waiting, _ in s.waiting] == [shorts[8]]
    s.finish(shorts[0])
    assert s.admit()[0] == [shorts[8]] and s.used_blocks == 40
    s.finish(long_one)
    assert s.used_blocks == 8


def test_a_request_larger_than_the_whole_cache_is_refused_at_once():
    with pytest.raises(InvalidRequest, match="more than the whole cache"):
        scheduler(kv_blocks=2, kv_block_size=4).submit(Seq(8))


def test_prefill_is_chunked_under_the_budget_while_every_decoder_steps():
    s = scheduler(max_running=3, prefill_chunk=8)
    decoding, long_one, short_one = Seq(4), Seq(20), Seq(3)
    decoding.prefilled = 4
    for sequence in (decoding, long_one, short_one):
        s.submit(sequence)
    plan = s.plan()
    assert plan.decode == [decoding]
    assert [(c.sequence, c.start, c.stop) for c in plan.prefill] == [(long_one, 0, 8)]
    long_one.prefilled = 16
    plan = s.plan()
    assert [(c.sequence, c.start, c.stop, c.completes_prompt) for c in plan.prefill] == [
        (long_one, 16, 20, True), (short_one, 0, 3, True)]


def test_shared_steps_give_each_client_at_most_fair_rows_taking_turns_and_a_lone_client_every_row():
    s = scheduler(max_running=8, fair_rows=2, fair_linger_s=1.0)
    flood = decoding_seqs(s, "flood", 4)
    assert s.plan().decode == flood  # alone: every row, nothing to share
    other = decoding_seqs(s, "other", 1)
    first, second = s.plan().decode, s.plan().decode
    assert first == flood[:2] + other and second == flood[2:] + other  # the rows that waited longest go next
    assert s.plan().decode == flood[:2] + other


def test_a_new_clients_last_prompt_chunk_runs_alone_and_earlier_chunks_beside_the_shared_rows():
    s = scheduler(max_running=8, prefill_chunk=8, fair_rows=2, fair_linger_s=1.0)
    flood = decoding_seqs(s, "flood", 4)
    short, long_one = Seq(3, client="other"), Seq(20, client="third")
    s.submit(long_one)
    plan = s.plan()  # the long prompt's first chunk does not hold its first token: the shared rows go with it
    assert plan.decode == flood[:2] and [(c.sequence, c.start, c.stop) for c in plan.prefill] == [(long_one, 0, 8)]
    long_one.prefilled = 8
    s.submit(short)
    plan = s.plan()  # the short prompt's only chunk is its last: its first token comes out of an iteration of its own
    assert plan.decode == [] and [(c.sequence, c.start, c.stop) for c in plan.prefill] == [(short, 0, 3)]
    short.prefilled = 3
    plan = s.plan()  # decoding now, `other` is served as the flood: fair rows each, the long prompt's next chunk beside
    assert plan.decode == flood[2:] + [short] and [(c.sequence, c.start, c.stop) for c in plan.prefill] == [
        (long_one, 8, 16)]


def test_new_clients_get_a_step_alone_only_together_within_the_budget_and_never_twice_in_a_row():
    s = scheduler(max_running=8, prefill_chunk=8, fair_rows=2, fair_linger_s=1.0)
    flood = decoding_seqs(s, "flood", 2)
    one, two, three = (Seq(3, client=name) for name in ("one", "two", "three"))
    for sequence in (one, two, three):
        s.submit(sequence)
    plan = s.plan()  # two prompts fit the 8-latent budget together; the third waits
    assert plan.decode == [] and [c.sequence for c in plan.prefill] == [one, two]
    one.prefilled = two.prefilled = 3
    plan = s.plan()  # no second such step in a row, however many new clients keep coming: the flood decodes
    assert plan.decode == flood + [one, two] and [c.sequence for c in plan.prefill] == [three]


def test_the_steps_stay_shared_for_the_linger_after_another_clients_request_ends_then_the_flood_gets_every_row():
    s = scheduler(max_running=8, fair_rows=2, fair_linger_s=1.0)
    flood = decoding_seqs(s, "flood", 4)
    other, = decoding_seqs(s, "other", 1)
    s.finish(other)
    assert len(s.plan().decode) == 2  # its user's next turn is likely on its way
    s.clock.now += 1.0
    assert s.plan().decode == flood


def test_would_place_foresees_submit_without_changing_anything():
    s = scheduler(max_running=2, kv_blocks=4, kv_block_size=4)
    s.submit(Seq(4, max_tokens=4))  # 2 blocks
    assert s.would_place(Seq(4, max_tokens=4)) and not s.would_place(Seq(8, max_tokens=4))  # 3 blocks: no room
    assert len(s.running) == 1 and s.used_blocks == 2
    s.submit(Seq(2, max_tokens=2))
    assert not s.would_place(Seq(1, max_tokens=1))  # no place left


def test_without_fair_rows_every_decoder_steps_whatever_its_client():
    s = scheduler(max_running=8)
    everyone = decoding_seqs(s, "flood", 4) + decoding_seqs(s, "other", 1)
    assert s.plan().decode == everyone


class ListOutput:
    def __init__(self):
        self.responses, self.error, self.ended, self.cancel_asked = [], None, False, False

    def send(self, response):
        assert not self.finished, "a response after the last one"
        self.responses.append(response)

    def fail(self, message, outcome):
        assert not self.finished
        self.error, self.outcome = message, outcome

    def end(self):
        assert not self.finished
        self.ended = True

    def is_cancelled(self):
        return self.cancel_asked

    @property
    def finished(self):
        return self.error is not None or self.ended or any(r.finish_reason for r in self.responses)

    @property
    def tokens(self):
        return [t for r in self.responses for t in r.output_ids]


def make_loop(directory, tokenizer, threshold, **overrides):
    engine = OnnxComponents(directory)
    settings = dict(max_running=16, max_queue=16, wait_s=30.0, prefill_chunk=4, kv_blocks=1000, kv_block_size=16)
    settings.update(overrides)
    return engine, DecodeLoop(Executor.in_process(engine), tokenizer, Scheduler(**settings), threshold)


def submit(loop, engine, tokenizer, request_id, prompt, max_tokens=24, sends=None, stream=True, client=""):
    prepared = PreparedRequest(tokenizer.encode_prompt(prompt), SamplingParams(max_tokens=max_tokens), stream, True,
                               client=client)
    prompt_ids = pad_prompt(prepared.prompt_ids, engine.pair_size, engine.pad_id)
    output = ListOutput()
    loop.submit(request_id, prepared, engine.compress(np.asarray(prompt_ids).reshape(-1, engine.pair_size)),
                output if sends is None else QueuedOutput(output, sends))
    return output


def run_until_idle(loop, limit=500):
    for _ in range(limit):
        if not loop.run_once():
            return
    raise AssertionError("the loop never went idle")


@pytest.mark.parametrize("name, threshold", [("baseline", 1.0), ("dualend", -1.0), ("dualend", 0.5),
                                             ("dualend", 1.0)])
def test_batched_chunked_decoding_equals_one_at_a_time(exported, tiny_tokenizer, name, threshold):
    _, directory = exported[name]
    engine, loop = make_loop(directory, tiny_tokenizer, threshold)
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p) for i, p in enumerate(PROMPTS)]
    run_until_idle(loop)
    for prompt, output in zip(PROMPTS, outputs):
        alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=24), threshold)
        assert output.tokens == alone.tokens and output.error is None
        assert sum(r.counters["num_accepted_drafts"] for r in output.responses) == alone.accepted
        assert output.responses[-1].finish_reason == alone.finish_reason
    assert not engine.backbone.cache.sequences and not engine.mtp_pool_sequences()


@pytest.mark.parametrize("name, threshold", [("baseline", 1.0), ("dualend", 0.5)])
def test_shared_steps_skip_rows_and_still_decode_exactly_what_each_request_decodes_alone(exported, tiny_tokenizer,
                                                                                        name, threshold):
    _, directory = exported[name]
    engine, loop = make_loop(directory, tiny_tokenizer, threshold, fair_rows=1, fair_linger_s=1.0)
    clients = ["flood", "flood", "flood", "flood", "other"]
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p, client=c) for i, (p, c) in enumerate(zip(PROMPTS, clients))]
    calls = []  # (rows the engine call ran, rows in use)
    run = engine.backbone._run
    engine.backbone._run = lambda latents, *rest: calls.append(
        (len(latents), len(engine.backbone.cache.row_owner))) or run(latents, *rest)
    run_until_idle(loop)
    assert (2, 5) in calls  # two rows of five stepped, run over their own (copied) past
    for prompt, output in zip(PROMPTS, outputs):
        alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=24), threshold)
        assert output.tokens == alone.tokens and output.error is None
    assert not engine.backbone.cache.sequences and not engine.mtp_pool_sequences()


def test_requests_beyond_the_places_queue_and_all_complete(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 0.5, max_running=2, max_queue=8)
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    loop.run_once()
    assert len(loop.scheduler.running) == 2 and len(loop.scheduler.waiting) == 6
    run_until_idle(loop)
    assert all(o.responses and o.responses[-1].finish_reason for o in outputs)


def test_a_full_queue_refuses_and_the_others_go_on(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 0.5, max_running=1, max_queue=1)
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, PROMPTS[i]) for i in range(3)]
    run_until_idle(loop)
    assert "the queue (max_queue_size 1) is full" in outputs[2].error
    assert all(o.responses[-1].finish_reason for o in outputs[:2])


def test_cancelling_frees_every_cache_at_once(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, -1.0)
    by_id, by_sender = (submit(loop, engine, tiny_tokenizer, i, PROMPTS[i], max_tokens=200) for i in (1, 2))
    for _ in range(4):
        loop.run_once()
    assert len(engine.backbone.cache.sequences) == 2
    loop.cancel(1)
    by_sender.cancel_asked = True
    for sequence in loop.live.values():
        sequence.next_cancel_check = 0.0  # due now
    loop.run_once()
    assert not loop.live
    assert by_id.ended and by_sender.ended and not by_id.error
    assert not engine.backbone.cache.sequences and not engine.mtp_pool_sequences()


def test_a_long_prompt_prefills_in_chunks_while_the_others_keep_streaming(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0, prefill_chunk=4)
    running = submit(loop, engine, tiny_tokenizer, 1, PROMPTS[0], max_tokens=40)
    while not running.responses:
        loop.run_once()
    long_prompt = " ".join(["x = 1"] * 12)
    newcomer = submit(loop, engine, tiny_tokenizer, 2, long_prompt, max_tokens=4)
    prompt_tokens = len(tiny_tokenizer.encode_prompt(long_prompt))
    iterations = 0
    while not newcomer.responses:
        before = len(running.responses)
        loop.run_once()
        iterations += 1
        assert len(running.responses) == before + 1  # the running stream got its token in this iteration
    assert iterations == -(-prompt_tokens // 4)  # one chunk of 4 latents per iteration


def test_stopping_ends_every_request_with_the_reason(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, -1.0, max_running=1)
    outputs = [submit(loop, engine, tiny_tokenizer, i, PROMPTS[i], max_tokens=100) for i in (1, 2)]
    loop.run_once()
    loop.close("the server is shutting down")
    assert all(o.error == "the server is shutting down" for o in outputs)
    assert not loop.live and not loop.scheduler.running


def test_a_drained_loop_refuses_what_arrives_with_or_after_the_drain_with_the_same_message(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    recorder = loop.observer = Recorder()
    running = submit(loop, engine, tiny_tokenizer, 1, PROMPTS[0], max_tokens=100)
    loop.run_once()
    alongside = submit(loop, engine, tiny_tokenizer, 2, PROMPTS[1])
    loop.drain("the server is shutting down")
    loop.run_once()
    late = submit(loop, engine, tiny_tokenizer, 3, PROMPTS[2])
    run_until_idle(loop)
    assert running.error == alongside.error == late.error == "the server is shutting down"
    assert not alongside.responses and not late.responses
    assert not loop.live and not engine.backbone.cache.sequences
    assert recorder.calls["refused"] == [(Outcome.SHUTTING_DOWN,)] * 3
    assert running.outcome == alongside.outcome == late.outcome == Outcome.SHUTTING_DOWN


class Recorder:
    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        return lambda *args: self.calls.setdefault(name, []).append(args)


def test_the_phases_add_up_over_known_requests(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, -1.0, max_running=2, max_queue=8)
    recorder = loop.observer = Recorder()
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, PROMPTS[i % len(PROMPTS)]) for i in range(5)]
    run_until_idle(loop)
    tokens = sum(len(o.tokens) for o in outputs)
    steps = sum(r.counters["num_steps"] for o in outputs for r in o.responses)
    calls = recorder.calls
    assert len(calls["queued"]) == len(calls["prefilled"]) == len(calls["first_token"]) == 5
    first_tokens = sum(len(o.responses[next(i for i, r in enumerate(o.responses) if r.output_ids)].output_ids)
                       for o in outputs)
    assert sum(n for _, n in calls["inter_token"]) + first_tokens == tokens
    assert len(calls["step"]) == steps and sum(n for (n,) in calls["step"]) == tokens
    assert max(waiting for _, _, waiting, _, _ in calls["flush"]) == 3  # 5 requests, 2 places
    assert calls["flush"][-1] == (True, 0, 0, 0.0, 0)  # idle at the end: nothing running, waiting or held
    assert all(s >= 0 for (s,) in calls["queued"]) and "refused" not in calls


def test_a_request_answered_in_one_response_counts_its_first_token_when_it_was_decoded(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, -1.0, max_running=2, max_queue=8)
    recorder = loop.observer = Recorder()
    clock = iter(range(1000))
    loop.clock = lambda: float(next(clock))  # one tick per reading: the first token comes before the end
    output = submit(loop, engine, tiny_tokenizer, 1, PROMPTS[0], max_tokens=24, stream=False)
    run_until_idle(loop)
    assert len(output.responses) == 1 and len(output.tokens) > 2
    ((ttft,),) = recorder.calls["first_token"]
    assert 0 < ttft < next(clock) / 2  # after its prefill, not at the end of the whole answer
    assert "inter_token" not in recorder.calls  # one response: no gap between sends


def test_metrics_accumulate_as_prometheus_histograms_and_hand_out_deltas():
    from dualend.serving.metrics import PhaseMetrics

    metrics = PhaseMetrics()
    for seconds in (0.003, 0.003, 0.2, 60.0):
        metrics.first_token(seconds)
    metrics.inter_token(0.004, 3)
    metrics.iteration(0.01)
    metrics.flush(False, 5, 2, 0.25, 3)
    delta = metrics.take()
    ttft = delta.histograms["dualend_ttft_seconds"]
    bounds = ttft.bounds
    assert ttft.counts[bounds.index(0.0025)] == 0 and ttft.counts[bounds.index(0.005)] == 2
    assert ttft.counts[bounds.index(0.25)] == 3 and ttft.counts[-1] == 4  # +Inf holds the 60 s one
    assert abs(ttft.total - 60.206) < 1e-9
    assert delta.histograms["dualend_inter_token_seconds"].counts[-1] == 3
    assert delta.gauges == {"dualend_running_sequences": 5, "dualend_waiting_requests": 2,
                            "dualend_kv_cache_usage": 0.25, "dualend_prefix_cache_entries": 3,
                            "dualend_synthetic_acceptance_rate": -1.0}  # off: the gate decides
    again = metrics.take()
    assert again.histograms["dualend_ttft_seconds"].counts[-1] == 0 and again.gauges == {}


def test_an_unexpected_error_ends_the_requests_in_the_loop_and_the_loop_goes_on(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    first = submit(loop, engine, tiny_tokenizer, 1, PROMPTS[0])
    for _ in range(3):
        loop.run_once()  # prefilled, decoding
    logged = []
    loop.log_error = logged.append
    compress = loop.executor.compress
    loop.executor.compress = lambda pairs: (_ for _ in ()).throw(MemoryError("no room"))
    assert loop.run_once() is False  # the error ends what was running, and the loop rests a moment
    assert first.error == "internal error in the decode loop: MemoryError('no room')"
    assert len(logged) == 1 and "Traceback" in logged[0] and "MemoryError: no room" in logged[0]  # for the operator
    loop.executor.compress = compress
    later = submit(loop, engine, tiny_tokenizer, 2, PROMPTS[1])
    run_until_idle(loop)
    assert later.responses[-1].finish_reason and later.error is None


def test_a_request_whose_admission_fails_gets_its_last_word_and_the_ones_after_it_are_taken_in(exported,
                                                                                                  tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    logged = []
    loop.log_error = logged.append
    submit_to_scheduler = loop.scheduler.submit

    def placed_then_failed(sequence):  # fails after the scheduler gave it a place and blocks
        submit_to_scheduler(sequence)
        if sequence.request_id == 1:
            raise ZeroDivisionError("admission")
    loop.scheduler.submit = placed_then_failed
    broken, healthy = (submit(loop, engine, tiny_tokenizer, n, PROMPTS[n]) for n in (1, 2))
    run_until_idle(loop)
    assert broken.error == "internal error admitting this request" and broken.outcome == Outcome.STEP_FAILED
    assert healthy.responses[-1].finish_reason and healthy.error is None
    assert len(logged) == 1 and "ZeroDivisionError" in logged[0]
    assert not loop.scheduler.running and loop.scheduler.used_blocks == 0  # its place and blocks came back


def test_a_sequence_whose_step_fails_ends_alone_and_the_others_finish(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 0.5)
    sampled = PreparedRequest(tiny_tokenizer.encode_prompt(PROMPTS[0]), SamplingParams(max_tokens=24, temperature=1.0),
                              True, True)
    broken = ListOutput()
    pairs = np.asarray(pad_prompt(sampled.prompt_ids, engine.pair_size, engine.pad_id)).reshape(-1, engine.pair_size)
    loop.submit(1, sampled, engine.compress(pairs), broken)
    healthy = submit(loop, engine, tiny_tokenizer, 2, PROMPTS[1])
    run_backbone = loop.executor.run_backbone

    def nan_for_request_1(batch):  # logits no sampler can draw from, for one sequence only
        result = run_backbone(batch)
        if 1 in batch.sequence_ids:
            result.logits[batch.sequence_ids.index(1)] = np.nan
        return result

    loop.executor.run_backbone = nan_for_request_1
    run_until_idle(loop)
    assert broken.error.startswith("internal error decoding this request: ValueError(")
    assert healthy.error is None and healthy.responses[-1].finish_reason and not loop.live
    alone = submit(loop, engine, tiny_tokenizer, 3, PROMPTS[1])  # the same request, nothing failing beside it
    loop.executor.run_backbone = run_backbone
    run_until_idle(loop)
    assert healthy.tokens == alone.tokens


def test_sends_through_the_send_thread_arrive_as_the_loop_sent_them(exported, tiny_tokenizer):
    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, 0.5)
    errors = []
    sends = SendThread(on_error=errors.append)
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p, sends=sends) for i, p in enumerate(PROMPTS)]
    run_until_idle(loop)
    assert sends.close(timeout_s=10) and errors == []
    for prompt, output in zip(PROMPTS, outputs):
        alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=24), 0.5)
        assert output.tokens == alone.tokens and output.responses[-1].finish_reason == alone.finish_reason


class ThreadRecordingOutput(ListOutput):
    def __init__(self, fail_sends=False):
        super().__init__()
        self.fail_sends, self.threads = fail_sends, set()

    def send(self, response):
        self.threads.add(threading.get_ident())
        if self.fail_sends:
            raise RuntimeError("the client is gone")
        super().send(response)


def test_the_send_thread_keeps_order_survives_a_lost_client_and_delivers_everything_before_closing():
    errors = []
    sends = SendThread(on_error=errors.append, max_queued=2)  # a small queue: put waits for the thread
    lost, kept = ThreadRecordingOutput(fail_sends=True), ThreadRecordingOutput()
    lost_out, kept_out = QueuedOutput(lost, sends), QueuedOutput(kept, sends)
    for i in range(50):
        lost_out.send(Response([i], {}, None))
        kept_out.send(Response([i], {}, None))
    kept_out.end()
    assert sends.close(timeout_s=10)
    assert [r.output_ids for r in kept.responses] == [[i] for i in range(50)] and kept.ended
    assert len(errors) == 50 and all("the client is gone" in e for e in errors)
    assert threading.get_ident() not in kept.threads | lost.threads
    assert lost_out.is_cancelled() and not kept_out.is_cancelled()  # the loop stops decoding for a lost client
    kept.cancel_asked = True
    assert kept_out.is_cancelled()


def test_blocks_are_given_back_once_however_a_sequence_ends():
    s = scheduler(max_running=2, kv_blocks=8, kv_block_size=4)
    running, other, queued = Seq(4), Seq(4), Seq(4)   # 12 slots: 3 blocks each
    for sequence in (running, other, queued):
        s.submit(sequence)
    assert s.used_blocks == 6 and s.kv.free_blocks == 2 and queued not in s.kv
    assert s.finish(running) and not s.finish(running)   # freed once; a second end frees nothing
    assert not s.finish(queued)                            # never admitted: it held no blocks
    assert s.finish(other) and s.used_blocks == 0 and len(s.kv) == 0


class ScriptedBackbone:
    """The in-process backbone, counting each release it is told, and failing the sequences in
    `fail` ({request id: SequenceStatus}) with that status."""

    def __init__(self, runner):
        self.runner, self.released, self.fail = runner, [], {}

    def run_batch(self, batch):
        self.released += batch.releases
        result = self.runner.run_batch(batch)
        for index, seq_id in enumerate(batch.sequence_ids):
            if seq_id in self.fail:
                result.fail(index, self.fail[seq_id], f"scripted {self.fail[seq_id].name}")
        return result


def test_every_way_a_sequence_ends_frees_its_blocks_and_rows_exactly_once(exported, tiny_tokenizer):
    """Finished, failed by the backbone, cancelled, refused at the queue: the scheduler's block manager
    ends at 0, the backbone's and the MTP head's caches are empty, and the backbone was told to
    release each admitted sequence once."""
    from dualend.engine.onnx_engine import SequenceStatus

    _, directory = exported["dualend"]
    engine, loop = make_loop(directory, tiny_tokenizer, -1.0, max_running=4, max_queue=1)
    backbone = loop.executor.backbone = ScriptedBackbone(engine.backbone)
    backbone.fail = {2: SequenceStatus.EVICTED, 3: SequenceStatus.NO_ROOM}
    outputs = {i: submit(loop, engine, tiny_tokenizer, i, PROMPTS[i % len(PROMPTS)], max_tokens=60)
               for i in range(1, 7)}
    for _ in range(3):
        loop.run_once()
    loop.cancel(4)
    run_until_idle(loop)
    assert outputs[1].responses[-1].finish_reason and outputs[5].responses[-1].finish_reason
    assert outputs[2].error.startswith("the backbone lost this stream's sequence")
    assert outputs[2].error.endswith("retry: scripted EVICTED")
    assert outputs[3].error == "scripted NO_ROOM"
    assert outputs[4].ended and "is full" in outputs[6].error  # 5 waited for a place, 6 found the queue full
    assert loop.scheduler.used_blocks == 0 and len(loop.scheduler.kv) == 0
    assert not engine.backbone.cache.sequences and not engine.mtp_pool_sequences()
    assert sorted(backbone.released) == [1, 2, 3, 4, 5]  # each admitted one once; 6 was never admitted


def test_the_backbone_says_what_went_wrong_per_sequence_with_a_status(exported):
    from dualend.engine.onnx_engine import BackboneBatch, SequenceStatus

    _, directory = exported["baseline"]
    engine = OnnxComponents(directory)
    runner, cache = engine.backbone, engine.backbone.cache
    latents = np.zeros((4, engine.exported.settings["d_model"]), np.float32)

    def run(ids, counts, reserves):
        result = runner.run_batch(BackboneBatch(ids, latents[:sum(counts)], counts, reserves, []))
        return [SequenceStatus(s) for s in result.status], result.messages

    assert run([1, 2], [2, 1], [3, 1]) == ([SequenceStatus.OK] * 2, ["", ""])
    status, messages = run([1, 2, 7], [1, 1, 1], [0, 0, 0])  # 2 reserved 1 slot and holds it; 7 never started
    assert status == [SequenceStatus.OK, SequenceStatus.NO_ROOM, SequenceStatus.UNKNOWN_SEQUENCE]
    assert "outgrew its reservation of 1" in messages[1] and "holds no KV cache" in messages[2]
    assert run([1], [1], [4])[0] == [SequenceStatus.ALREADY_STARTED]
    cache.clock = lambda: 1e12  # long idle: the safety net evicts every row
    cache.evict_idle()
    assert run([1], [1], [0])[0] == [SequenceStatus.EVICTED]


def test_the_backbones_pool_metrics_report_what_changed(exported):
    from dualend.serving.metrics import PoolMetrics

    calls = []

    class Family:
        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels):
            family = self
            return type("Metric", (), {"set": lambda _, v: calls.append((family.name, "set", v)),
                                       "increment": lambda _, v: calls.append((family.name, "inc", v))})()

    _, directory = exported["baseline"]
    cache = OnnxComponents(directory).backbone.cache
    metrics = PoolMetrics(Family, {"model": "m"}, cache, block_size=4, capacity_blocks=10)
    assert calls == [("dualend_kv_blocks_used", "set", 0), ("dualend_kv_blocks_free", "set", 10),
                     ("dualend_kv_live_sequences", "set", 0)]
    calls.clear()
    cache.reserve(1, 9)  # 3 blocks
    metrics.update()
    metrics.update()
    assert calls == [("dualend_kv_blocks_used", "set", 3), ("dualend_kv_blocks_free", "set", 7),
                     ("dualend_kv_live_sequences", "set", 1)]


class HangingBackbone:
    """The in-process backbone, which hangs (as a stopped process would) while `hang` is set."""

    def __init__(self, runner):
        self.runner, self.hang, self.go_on = runner, threading.Event(), threading.Event()

    def run_batch(self, batch):
        if self.hang.is_set():
            self.go_on.wait(30)
        return self.runner.run_batch(batch)


def test_a_hung_backbone_ends_its_requests_and_refuses_at_once_until_it_answers_again(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine = OnnxComponents(directory)
    backbone = HangingBackbone(engine.backbone)
    loop = DecodeLoop(Executor(backbone, engine, engine.exported.settings["d_model"], call_timeout_s=0.3),
                      tiny_tokenizer, Scheduler(max_running=4, max_queue=4, wait_s=30.0, prefill_chunk=4,
                                                kv_blocks=1000, kv_block_size=16), 1.0)
    running = submit(loop, engine, tiny_tokenizer, 1, PROMPTS[0], max_tokens=200)
    for _ in range(6):
        loop.run_once()
    backbone.hang.set()
    started = time.monotonic()
    loop.run_once()
    assert 0.3 <= time.monotonic() - started < 2 and "did not answer within 0.3 s (a hung step)" in running.error
    assert running.outcome == Outcome.STEP_FAILED  # a retryable error
    refused = submit(loop, engine, tiny_tokenizer, 2, PROMPTS[1])
    started = time.monotonic()
    loop.run_once()
    loop.run_once()
    assert time.monotonic() - started < 0.2 and "has not answered a call for" in refused.error
    backbone.hang.clear()
    backbone.go_on.set()  # the stopped process goes on; its late answer is dropped
    time.sleep(0.2)
    served = submit(loop, engine, tiny_tokenizer, 3, PROMPTS[1])
    run_until_idle(loop)
    assert served.error is None and served.tokens == reference_text(engine, tiny_tokenizer, PROMPTS[1],
                                                                    SamplingParams(max_tokens=24), 1.0).tokens
    loop.executor.flush_releases()
    assert not engine.backbone.cache.sequences  # the ended requests' rows went with later calls


def test_a_preemptible_step_given_up_before_or_while_it_runs_writes_nothing_and_runs_alike_when_fed_again(exported):
    from dualend.engine.onnx_engine import BackboneBatch, SequenceStatus

    _, directory = exported["baseline"]
    engine, fresh = OnnxComponents(directory), OnnxComponents(directory)
    runner, cache = engine.backbone, engine.backbone.cache
    rng = np.random.default_rng(3)
    prompts = rng.standard_normal((6, engine.exported.settings["d_model"])).astype(np.float32)
    step = rng.standard_normal((2, engine.exported.settings["d_model"])).astype(np.float32)
    for backbone in (runner, fresh.backbone):
        backbone.run_batch(BackboneBatch([1, 2], prompts, [3, 3], [8, 8], []))
    lengths = cache.lengths.copy()

    def decode(preempt_id):
        result = runner.run_batch(BackboneBatch([1, 2], step, [1, 1], [0, 0], [], preempt_id=preempt_id))
        return result, [SequenceStatus(s) for s in result.status]

    runner.preempt(5)  # before its call reaches the runner
    assert decode(5)[1] == [SequenceStatus.PREEMPTED] * 2
    np.testing.assert_array_equal(cache.lengths, lengths)
    run = runner.session.run
    runner.session.run = lambda names, feeds, options=None: (runner.preempt(6), run(names, feeds, options))[1]
    result, status = decode(6)  # once its run began: ONNX Runtime stops it at its next node
    assert status == [SequenceStatus.PREEMPTED] * 2 and "another client's first token" in result.messages[0]
    np.testing.assert_array_equal(cache.lengths, lengths)
    runner.session.run = run
    runner.preempt(7)  # too late for step 7 or after: a preemption never reaches another step
    result, status = decode(8)
    assert status == [SequenceStatus.OK] * 2
    alike = fresh.backbone.run_batch(BackboneBatch([1, 2], step, [1, 1], [0, 0], []))
    np.testing.assert_allclose(result.logits, alike.logits, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths[:2], lengths[:2] + 1)


def test_a_new_clients_prompt_preempts_the_shared_step_in_flight_runs_next_alone_and_every_text_stays_exact(
        exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0, fair_rows=1, fair_linger_s=1.0, prefill_chunk=64)
    cache = engine.backbone.cache
    clients = ["flood", "flood", "flood", "other"]
    outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p, client=c) for i, (p, c) in enumerate(zip(PROMPTS, clients))]
    batches, newcomers = [], {}  # newcomers: request id -> (prompt, max_tokens, output)
    run_batch = engine.backbone.run_batch

    def watched(batch):
        for sequence in loop.live.values():  # the keys held are the pairs fed before this step, preempted steps or not
            if sequence.started and sequence.prefilled == sequence.num_latents:
                feeding = sequence.request_id in batch.sequence_ids
                assert cache.lengths[cache.row(sequence.request_id)] == (
                    sequence.num_latents + len(sequence.fed_pairs) - feeding)
        batches.append((list(batch.sequence_ids), batch.preempt_id))
        if batch.preempt_id and len(newcomers) < 4:  # a client with nothing running asks while a shared step runs
            request_id = 9 + len(newcomers)  # the first streams; the others want one token: they could preempt every step
            prompt, max_tokens = (PROMPTS[4], 24) if not newcomers else (PROMPTS[1], 1)
            newcomers[request_id] = (prompt, max_tokens, submit(loop, engine, tiny_tokenizer, request_id, prompt,
                                                                max_tokens=max_tokens, client=f"new {request_id}"))
        return run_batch(batch)
    engine.backbone.run_batch = watched
    run_until_idle(loop)
    given_up = [i for i, (_, preempt_id) in enumerate(batches[:-1]) if preempt_id and batches[i + 1][0] in
                ([r] for r in newcomers)]
    assert batches[given_up[0] + 1] == ([9], 0)  # the newcomer's whole prompt, alone, right after
    assert set(batches[given_up[0]][0]) < set(batches[given_up[0] + 2][0])  # then the steps it preempted, first
    assert len(given_up) >= 2 and loop.observer.counters["dualend_decode_steps_preempted"] == len(given_up)
    for i in given_up:  # never more steps given up than run to their end (newcomers cannot stall the others)
        completed = sum(1 for j in range(1, i) if j not in given_up and set(batches[j][0]) & {1, 2, 3, 4})
        assert given_up.index(i) < completed
    for prompt, output in zip(PROMPTS, outputs):
        alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=24), 1.0)
        assert output.tokens == alone.tokens and output.error is None
    for prompt, max_tokens, output in newcomers.values():
        alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=max_tokens), 1.0)
        assert output.tokens == alone.tokens and output.error is None
    assert not engine.backbone.cache.sequences


def test_a_second_clients_prompt_preempts_the_first_clients_step_too_and_without_sharing_nothing_is_preempted(
        exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    for fair_rows, expected in ((2, 1), (0, 0)):
        engine, loop = make_loop(directory, tiny_tokenizer, 1.0, fair_rows=fair_rows, fair_linger_s=1.0,
                                 prefill_chunk=64)
        outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p, client="alone") for i, p in enumerate(PROMPTS[:3])]
        run_batch, batches, second = engine.backbone.run_batch, [], []

        def watched(batch):
            batches.append((list(batch.sequence_ids), batch.preempt_id))
            if len(batches) == 3:  # the first client decodes alone, every row: a second client asks
                second.append(submit(loop, engine, tiny_tokenizer, 9, PROMPTS[4], client="second"))
            return run_batch(batch)
        engine.backbone.run_batch = watched
        run_until_idle(loop)
        assert loop.observer.counters["dualend_decode_steps_preempted"] == expected
        if expected:
            assert batches[2][0] == [1, 2, 3] and batches[2][1] and batches[3] == ([9], 0)
        for prompt, output in zip(PROMPTS[:3] + [PROMPTS[4]], outputs + second):
            alone = reference_text(engine, tiny_tokenizer, prompt, SamplingParams(max_tokens=24), 1.0)
            assert output.tokens == alone.tokens and output.error is None


def test_the_preemption_budget_never_gives_up_more_steps_than_ran_within_its_window():
    from dualend.serving.loop import PreemptionBudget

    clock = FakeClock()
    budget = PreemptionBudget(clock, window_s=1.0)
    assert not budget.allows()  # nothing ran yet
    budget.completed()
    assert budget.allows()
    budget.given_up()
    assert not budget.allows()
    clock.now = 0.5
    budget.completed()
    assert budget.allows()
    budget.given_up()
    assert not budget.allows()
    clock.now = 1.2  # the first completed and given-up steps left the window
    assert not budget.allows()
    budget.completed()
    assert budget.allows()


def test_a_signed_preemption_reaches_the_backbone_model_and_anything_else_is_dropped():
    import queue
    import secrets
    import socket

    from dualend.serving.preemption import PreemptListener, PreemptSender

    heard, secret = queue.Queue(), secrets.token_hex(8)  # each run of the suite its own socket name
    listener = PreemptListener("test_backbone", secret, heard.put)
    assert listener.bound.wait(5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as forger:
        forger.sendto(b"4 " + b"0" * 64, listener.address)  # the right address, no secret
    PreemptSender("test_backbone", "other secret").preempt(3)  # another pipeline's: another address
    sender = PreemptSender("test_backbone", secret)
    sender.preempt(5)
    assert heard.get(timeout=5) == 5 and heard.empty()
    second = PreemptListener("test_backbone", secret, heard.put)  # a reloaded backbone waits for the name
    time.sleep(0.3)
    assert not second.bound.is_set()
    listener.close()
    assert second.bound.wait(5)
    sender.preempt(6)
    assert heard.get(timeout=5) == 6
    second.close()
    sender.close()
