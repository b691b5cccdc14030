"""The prefix cache: what it matches, how the scheduler charges and evicts kept rows, the KV cache's
kept copies, and the loop on the exported tiny models, where a request that extends an earlier
one's conversation prefills only the rest and decodes exactly what it decodes without the cache."""
import numpy as np
import pytest

from dualend.engine.decode import SamplingParams
from dualend.engine.kv_pool import KVCache, UnknownSequence
from dualend.engine.onnx_engine import BackboneBatch, OnnxComponents, SequenceStatus
from dualend.engine.prefix_cache import PrefixCache
from dualend.engine.scheduler import Scheduler
from dualend.serving.contract import PreparedRequest
from dualend.serving.loop import DecodeLoop, Executor

from test_batch_loop import FakeClock, ListOutput, run_until_idle


def pairs(*ids, size=1):
    return np.asarray(ids, dtype=np.int64).reshape(-1, size)


def test_the_longest_shared_prefix_wins_and_never_the_last_prompt_pair():
    cache = PrefixCache(max_entries=4, ttl_s=60)
    cache.keep(1, pairs(1, 2, 3, 4))
    cache.keep(2, pairs(1, 2, 9, 9, 9))
    assert cache.match(pairs(1, 2, 3, 4, 5, 6)) == (1, 4)
    assert cache.match(pairs(1, 2, 9, 7)) == (2, 3)
    assert cache.match(pairs(1, 2, 3, 4)) == (1, 3)  # the same prompt again: its last pair is prefilled for its logits
    assert cache.match(pairs(5, 2, 3)) is None
    assert cache.match(pairs(1, 2, 3, 4, 5, 6), salt="bob") is None  # another tenant's prefixes are not its
    two = PrefixCache(max_entries=4, ttl_s=60)
    two.keep(1, pairs(1, 2, 3, 4, size=2))
    assert two.match(pairs(1, 2, 3, 5, 6, 7, size=2)) == (1, 1)  # pairs match whole or not at all


def test_entries_beyond_the_limit_and_past_their_time_go_oldest_first():
    clock = FakeClock()
    s = Scheduler(max_running=4, max_queue=4, wait_s=10.0, prefill_chunk=64, kv_blocks=100, kv_block_size=4,
                  clock=clock, prefix_cache=PrefixCache(max_entries=2, ttl_s=10, clock=clock))
    assert s.keep(1, pairs(1, 2)) and s.keep(2, pairs(3, 4))
    assert s.keep(3, pairs(5, 6)) and s.evicted_rows() == [1]
    assert not s.keep(4, pairs(7)) and s.evicted_rows() == []  # one pair leaves nothing a next request could reuse
    clock.now = 11
    assert s.evicted_rows() == [2, 3] and len(s.prefixes) == 0 and s.kv.used_blocks == 0


class Seq:
    def __init__(self, prompt, max_tokens=8):
        self.prompt_pairs, self.cache_salt = pairs(*prompt), ""
        self.num_latents, self.prefilled, self.reuse = len(prompt), 0, None
        self.reserve_slots = self.num_latents + max_tokens


def prefix_scheduler(kv_blocks=8, entries=4):
    return Scheduler(max_running=4, max_queue=4, wait_s=10.0, prefill_chunk=64, kv_blocks=kv_blocks,
                     kv_block_size=4, clock=FakeClock(), prefix_cache=PrefixCache(entries, 60))


def test_a_hit_takes_the_kept_row_over_and_prefills_only_the_rest():
    s = prefix_scheduler()
    first = Seq(range(1, 7))
    s.submit(first)
    s.finish(first)
    assert s.keep(11, pairs(*range(1, 10)))  # its prompt and three decoded tokens
    assert s.kv.used_blocks == 3
    turn = Seq([*range(1, 10), 20, 21])
    s.submit(turn)
    assert turn.reuse == (11, 9) and turn.prefilled == 9
    assert [(c.start, c.stop) for c in s.plan().prefill] == [(9, 11)]
    assert 11 not in s.prefixes and s.kv.used_blocks == s.kv.blocks_for(turn.reserve_slots)
    assert s.evicted_rows() == []  # taken over, not released


def test_kept_rows_never_delay_an_admission_they_are_evicted_oldest_first():
    s = prefix_scheduler(kv_blocks=8)
    for seq_id in (1, 2, 3):
        assert s.keep(seq_id, pairs(*range(seq_id * 10, seq_id * 10 + 8)))  # two blocks each
    big = Seq(range(100, 120), max_tokens=4)  # six blocks: room for one kept copy beside it
    s.submit(big)
    assert s.running == [big] and not s.waiting
    assert s.evicted_rows() == [1, 2] and s.prefixes.kept() == [3]
    assert s.evicted_rows() == []


def test_a_request_that_cannot_fit_evicts_nothing():
    s = prefix_scheduler(kv_blocks=8)
    s.submit(Seq(range(100, 120), max_tokens=4))
    assert s.keep(1, pairs(1, 2, 3, 4, 5))  # a copy of two blocks beside the running row's six
    waiting = Seq(range(200, 210))
    s.submit(waiting)
    assert [q for q, _ in s.waiting] == [waiting] and s.prefixes.kept() == [1]


def test_the_kv_cache_keeps_a_copy_outside_the_rows_and_a_new_sequence_starts_from_it():
    cache = KVCache(layers=2, heads=1, head_dim=2, max_sequences=4, bucket=4)
    row = cache.reserve(1, 8)
    keys = np.arange(2 * 1 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 1, 5, 2)
    cache.make_room([row], 5)
    cache.write([row], keys, -keys)
    assert cache.keep(1) and not cache.sequences and len(cache.past().lengths) == 0
    new_row = cache.adopt(2, donor_id=1, keep=3, slots=10)
    assert cache.length(2) == 3 and 1 not in cache.kept
    for layer in range(2):
        np.testing.assert_array_equal(cache.keys[layer][new_row, :, :3], keys[layer, 0, :, :3])
        np.testing.assert_array_equal(cache.values[layer][new_row, :, :3], -keys[layer, 0, :, :3])
    with pytest.raises(UnknownSequence, match="kept prefix of sequence 1 is gone"):
        cache.adopt(3, donor_id=1, keep=2, slots=10)
    assert 3 not in cache.sequences


def test_a_kept_copy_nobody_takes_is_dropped_after_its_time():
    clock = FakeClock()
    cache = KVCache(layers=1, heads=1, head_dim=2, max_sequences=2, bucket=4, clock=clock, kept_timeout_s=5)
    cache.reserve(1, 4)
    cache.make_room([0], 2)
    cache.write([0], np.ones((1, 1, 1, 2, 2), np.float32), np.ones((1, 1, 1, 2, 2), np.float32))
    cache.keep(1)
    clock.now = 6
    cache.evict_idle()
    assert not cache.kept


# --- the loop on the exported tiny models ------------------------------------------------------

def make_loop(directory, tokenizer, threshold, entries=8, kv_blocks=1000):
    engine = OnnxComponents(directory)
    scheduler = Scheduler(max_running=8, max_queue=8, wait_s=30.0, prefill_chunk=4, kv_blocks=kv_blocks,
                          kv_block_size=16, prefix_cache=PrefixCache(entries, 600) if entries else None)
    return engine, DecodeLoop(Executor.in_process(engine), tokenizer, scheduler, threshold)


def generate(loop, engine, request_id, prompt_ids, max_tokens=16):
    prepared = PreparedRequest(list(prompt_ids), SamplingParams(max_tokens=max_tokens), False, True)
    latents = engine.compress(prepared.prompt_pairs(engine.pair_size, engine.pad_id))
    output = ListOutput()
    loop.submit(request_id, prepared, latents, output)
    return output


def conversation(loop, engine, tokenizer, turns):
    """Each turn's prompt is the whole conversation so far plus a new message, as chat clients send it."""
    history, outputs = tokenizer.encode_prompt("Q: 1+2+3\nA:"), []
    for turn in range(turns):
        output = generate(loop, engine, turn + 1, history)
        run_until_idle(loop)
        assert output.error is None, output.error
        outputs.append(output)
        history = history + output.tokens + tokenizer.encode(f"\nQ: {turn}*4\nA:")
    return outputs


@pytest.mark.parametrize("name, threshold", [("baseline", 1.0), ("dualend", 0.5), ("baseline_mtp", 0.0),
                                             ("baseline_mtp_wrong", 0.0)])
def test_each_turn_reuses_the_conversation_so_far_and_decodes_the_same(exported, tiny_tokenizer, name, threshold):
    _, directory = exported[name]
    engine, loop = make_loop(directory, tiny_tokenizer, threshold)
    cached = conversation(loop, engine, tiny_tokenizer, 4)
    plain_engine, plain = make_loop(directory, tiny_tokenizer, threshold, entries=0)
    uncached = conversation(plain, plain_engine, tiny_tokenizer, 4)
    assert [o.tokens for o in cached] == [o.tokens for o in uncached]
    if name.startswith("baseline_mtp"):  # verified drafts, kept or dropped: still the baseline's text
        base_engine, base = make_loop(exported["baseline"][1], tiny_tokenizer, 1.0, entries=0)
        assert [o.tokens for o in conversation(base, base_engine, tiny_tokenizer, 4)] == [o.tokens for o in cached]
        counters = [r.counters for o in cached for r in o.responses]
        drafts, kept = sum(c["num_drafts"] for c in counters), sum(c["num_accepted_drafts"] for c in counters)
        assert drafts > 0 and kept == (0 if name.endswith("wrong") else drafts)
    reused = [o.responses[-1].counters["num_cached_tokens"] for o in cached]
    assert reused[0] == 0 and all(r == 0 for o in uncached for r in [o.responses[-1].counters["num_cached_tokens"]])
    for turn in range(1, 4):
        before = cached[turn - 1].responses[-1].counters
        # at least the previous turn's whole prompt; a token-level model also every decoded token it fed
        assert reused[turn] >= before["num_prompt_tokens"], reused
        if engine.pair_size == 1:
            assert reused[turn] == before["num_prompt_tokens"] + before["num_output_tokens"] - 1
    assert not engine.backbone.cache.sequences
    assert set(engine.backbone.cache.kept) == set(loop.scheduler.prefixes.kept())  # one owner, in step
    gauges = loop.observer.gauges
    assert gauges["dualend_prefix_cache_entries"] == len(loop.scheduler.prefixes) > 0
    assert gauges["dualend_kv_cache_usage"] == loop.scheduler.used_blocks / loop.scheduler.kv_blocks > 0


def test_a_drained_loop_releases_every_kept_row(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    conversation(loop, engine, tiny_tokenizer, 2)
    assert engine.backbone.cache.kept
    loop.drain("draining")
    run_until_idle(loop)
    assert not engine.backbone.cache.kept and not len(loop.scheduler.prefixes)


def test_a_request_cancelled_before_it_took_its_kept_row_over_releases_it(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    first = conversation(loop, engine, tiny_tokenizer, 1)[0]
    history = tiny_tokenizer.encode_prompt("Q: 1+2+3\nA:") + first.tokens
    generate(loop, engine, 7, history + tiny_tokenizer.encode(" more"))
    loop._take_inbox()
    assert loop.live[7].reuse is not None
    loop.cancel(7)
    run_until_idle(loop)
    assert not engine.backbone.cache.kept and not engine.backbone.cache.sequences


def test_a_kept_row_the_backbone_lost_is_prefilled_afresh(exported, tiny_tokenizer):
    _, directory = exported["baseline"]
    engine, loop = make_loop(directory, tiny_tokenizer, 1.0)
    first = conversation(loop, engine, tiny_tokenizer, 1)[0]
    engine.backbone.cache.kept.clear()  # as if its copy had been dropped after kept_timeout_s
    history = tiny_tokenizer.encode_prompt("Q: 1+2+3\nA:") + first.tokens + tiny_tokenizer.encode(" more")
    again = generate(loop, engine, 2, history)
    run_until_idle(loop)
    plain_engine, plain = make_loop(directory, tiny_tokenizer, 1.0, entries=0)
    alone = generate(plain, plain_engine, 2, history)
    run_until_idle(plain)
    assert again.error is None and again.tokens == alone.tokens
    assert again.responses[-1].counters["num_cached_tokens"] == 0


def test_the_backbone_answers_prefix_gone_for_a_copy_it_does_not_hold(exported):
    _, directory = exported["baseline"]
    engine = OnnxComponents(directory)
    d_model = engine.exported.settings["d_model"]
    batch = BackboneBatch([5], np.zeros((2, d_model), np.float32), [2], [8], [], reuse_ids=[99], reuse_slots=[3])
    result = engine.backbone.run_batch(batch)
    assert result.status == [SequenceStatus.PREFIX_GONE] and "kept prefix of sequence 99" in result.messages[0]
    assert not engine.backbone.cache.sequences


def test_a_new_copy_that_needs_room_evicts_older_ones_and_keeps_itself():
    s = prefix_scheduler(kv_blocks=4)
    assert s.keep(1, pairs(*range(10, 18)))  # two blocks each
    assert s.keep(2, pairs(*range(20, 28)))
    assert s.keep(3, pairs(*range(30, 38)))
    assert s.prefixes.kept() == [2, 3] and s.evicted_rows() == [1]


def test_an_adoption_that_finds_no_room_leaves_the_copy_for_its_owner_to_release():
    cache = KVCache(layers=1, heads=1, head_dim=2, max_sequences=1, bucket=4)
    cache.reserve(1, 4)
    cache.make_room([0], 2)
    cache.write([0], np.ones((1, 1, 1, 2, 2), np.float32), np.ones((1, 1, 1, 2, 2), np.float32))
    cache.keep(1)
    cache.reserve(2, 4)  # the one row is taken
    with pytest.raises(Exception, match="all 1 sequence rows are taken"):
        cache.adopt(3, donor_id=1, keep=2, slots=4)
    assert 1 in cache.kept and 3 not in cache.sequences and 2 in cache.sequences
    with pytest.raises(UnknownSequence, match="cannot reuse 3 slots"):
        cache.adopt(3, donor_id=1, keep=3, slots=4)
    assert 1 not in cache.kept  # a copy that cannot serve is dropped
