"""The OpenAI-compatible front without a server: request translation, error mapping, usage, API keys,
the cap per key, the down marks and the models tritonserver has ready."""
import asyncio
import json

import numpy as np
import pytest

from dualend.ops.api_keys import ApiKey, KeysFileError, client_of, key_hash, read_keys
from dualend.ops.openai_api.front import DownMarks, KeyCaps, Progress, Readiness
from dualend.ops.openai_api.translation import (MAX_JSON_DEPTH, ApiError, chunk_body, parse_body, parse_chat,
                                                parse_completion, response_body,
                                                triton_error, triton_inputs, usage)
from dualend.serving.outcomes import DISPOSITIONS, Outcome, outcome_of, tagged

COUNTERS = {"num_output_tokens": 5, "num_drafts": 3, "num_accepted_drafts": 2, "num_steps": 3,
            "num_prompt_tokens": 7, "num_prompt_latents": 4, "num_cached_tokens": 6}


def test_a_completion_becomes_the_ensembles_streamed_inputs():
    request = parse_completion({"model": "dualend", "prompt": "Q: 1+1\nA:", "max_tokens": 9, "temperature": 0,
                                "top_p": 0.5, "seed": 3, "stop": "\n"})
    inputs = triton_inputs(request)
    assert inputs["text_input"][0] == b"Q: 1+1\nA:" and inputs["max_tokens"].dtype == np.int32
    assert inputs["max_tokens"][0] == 9 and inputs["stream"][0] and inputs["exclude_input_in_output"][0]
    assert inputs["temperature"][0] == 0 and inputs["top_p"][0] == np.float32(0.5)
    assert inputs["random_seed"].dtype == np.uint64 and list(inputs["stop_words"]) == [b"\n"]


def test_max_completion_tokens_wins_and_defaults_apply():
    assert parse_completion({"model": "m", "prompt": "x", "max_tokens": 3, "max_completion_tokens": 5}).max_tokens == 5
    assert parse_completion({"model": "m", "prompt": "x"}).max_tokens == 16
    request = parse_completion({"model": "m", "prompt": ["x"], "stop": ["a", "b"]})
    assert request.prompt == "x" and request.stop == ["a", "b"] and "temperature" not in triton_inputs(request)


def test_a_chat_without_max_tokens_gets_the_default_cut_to_the_room_left():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    render = lambda messages: "prompt"  # noqa: E731
    assert parse_chat(body, render, lambda prompt: 1000).max_tokens == 128
    assert parse_chat(body, render, lambda prompt: 40).max_tokens == 40
    assert parse_chat(body, render, lambda prompt: 0).max_tokens == 1  # no room: the deployment says so
    assert parse_chat(body, render, lambda prompt: None).max_tokens == 128  # the limit unknown
    asked = []
    assert parse_chat(body | {"max_tokens": 300}, render, lambda prompt: asked.append(prompt) or 40).max_tokens == 300
    assert not asked  # a max_tokens given is the client's: too long for the room, the deployment refuses it


def test_without_a_seed_each_sampled_request_draws_its_own_and_a_seed_given_is_sent():
    """OpenAI's clients expect a fresh sample per request; the contract's default seed (0) would give
    every unseeded sampled request the same draws. A greedy one sends none, as Triton's routes."""
    body = {"model": "m", "prompt": "x", "temperature": 1.0}
    seeds = {int(triton_inputs(parse_completion(body))["random_seed"][0]) for _ in range(4)}
    assert len(seeds) == 4
    assert triton_inputs(parse_completion(body | {"seed": 0}))["random_seed"][0] == 0
    for greedy in ({"temperature": 0}, {}):
        assert "random_seed" not in triton_inputs(parse_completion({"model": "m", "prompt": "x"} | greedy))


def test_top_k_is_sent_and_vllms_off_values_send_none():
    assert triton_inputs(parse_completion({"model": "m", "prompt": "x", "top_k": 5}))["top_k"][0] == 5
    for off in (0, -1):
        assert "top_k" not in triton_inputs(parse_completion({"model": "m", "prompt": "x", "top_k": off}))


@pytest.mark.parametrize("route, field, hint", [
    (parse_completion, "temprature", "temperature"), (parse_completion, "max_token", "max_tokens"),
    (parse_completion, "messages", None), (parse_chat, "prompt", None), (parse_completion, "best_of_n", "best_of"),
])
def test_a_field_nobody_reads_is_a_400_that_names_it_and_guesses_a_typo(route, field, hint):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    body = {k: v for k, v in body.items() if k != {parse_completion: "messages", parse_chat: "prompt"}[route]}
    with pytest.raises(ApiError) as refused:
        route(body | {field: 1}, lambda m: "x") if route is parse_chat else route(body | {field: 1})
    assert refused.value.status == 400 and refused.value.param == field
    assert f"`{field}` is not a field of /v1/" in refused.value.message
    assert (f"did you mean `{hint}`" in refused.value.message) if hint else "did you mean" not in refused.value.message


def test_fields_without_effect_pass_and_ones_that_would_change_the_answer_only_at_their_neutral_value():
    body = {"model": "m", "prompt": "x", "user": "u", "logit_bias": {}, "presence_penalty": 0, "tool_choice": "none",
            "suffix": ""}
    assert parse_completion(body).prompt == "x"
    # vLLM's benchmark client (`vllm bench serve --backend openai`) sends repetition_penalty 1.0 on every request
    assert parse_completion({"model": "m", "prompt": "x", "repetition_penalty": 1.0, "min_p": 0}).prompt == "x"
    for field, value in (("repetition_penalty", 1.2), ("min_p", 0.05), ("presence_penalty", 0.5),
                         ("frequency_penalty", -1), ("logit_bias", {"5": -100}), ("suffix", "}")):
        with pytest.raises(ApiError) as refused:
            parse_completion({"model": "m", "prompt": "x", field: value})
        assert refused.value.param == field and "not supported" in refused.value.message


@pytest.mark.parametrize("change, accepted", [
    ({"min_tokens": 8, "max_tokens": 8, "ignore_eos": True}, True), ({"min_tokens": 0}, True),
    ({"min_tokens": 8, "max_tokens": 8}, False), ({"min_tokens": 9, "max_tokens": 8, "ignore_eos": True}, False),
    ({"min_tokens": 8, "max_tokens": 8, "ignore_eos": True, "stop": "\n"}, False),
])
def test_min_tokens_passes_only_where_every_answer_is_max_tokens_long(change, accepted):
    body = {"model": "m", "prompt": "x"} | change
    if accepted:
        assert parse_completion(body).max_tokens == change.get("max_tokens", 16)
    else:
        with pytest.raises(ApiError) as refused:
            parse_completion(body)
        assert refused.value.param == "min_tokens" and "ignore_eos" in refused.value.message


@pytest.mark.parametrize("change, param", [
    ({"model": None}, "model"), ({"n": 2}, "n"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "9"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
])
def test_a_malformed_field_is_a_400_that_names_it(change, param):
    body = {"model": "dualend", "prompt": "x"} | change
    with pytest.raises(ApiError) as refused:
        parse_completion(body)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
])
def test_malformed_messages_are_named(messages, param):
    with pytest.raises(ApiError) as refused:
        parse_chat({"model": "m", "messages": messages}, lambda m: "")
    assert refused.value.param == param


@pytest.mark.parametrize("body, message, param", [
    (b'{"model": "m", "prompt": "a\\ud800b"}', "`prompt` is not valid text: it holds a lone UTF-16 surrogate", "prompt"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "`messages[0].content[0].text` is not valid text", "messages"),
    (b'{"model": "m", "stop": ["ok", "\\ud83d"]}', "`stop[1]` is not valid text", "stop"),
    (b'{"\\ud800": 1}', "is not valid text", None),
    (b"[" * 5000 + b"]" * 5000, "nests JSON deeper than", None),
    (b'{"metadata": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, "nests JSON deeper than 32 levels, at `metadata.a.a", "metadata"),
    (b'\xff{"model": "m"}', "not JSON (UTF-8 text)", None),
    (b'"a string"', "must be a JSON object", None),
    (b"[1, 2]", "must be a JSON object", None),
])
def test_a_body_no_tokenizer_could_take_is_a_400_that_says_why(body, message, param):
    with pytest.raises(ApiError) as refused:
        parse_body(body)
    assert refused.value.status == 400 and message in refused.value.message and refused.value.param == param
    json.dumps(refused.value.body()).encode("utf-8")  # the refusal itself is sendable


def test_valid_text_and_nesting_up_to_the_limit_pass():
    text = r"caf\u00e9 \ud83d\ude00 \u4e2d"  # an escaped surrogate pair is one valid character
    body = ('{"model": "m", "prompt": "' + text + '", "metadata": ' + '{"a": ' * (MAX_JSON_DEPTH - 1) + "1"
            + "}" * MAX_JSON_DEPTH).encode()
    parsed = parse_body(body)
    assert parsed["prompt"] == "café 😀 中" and parse_completion(parsed).prompt == "café 😀 中"


def test_chat_renders_the_flattened_history():
    seen = []
    request = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]},
        lambda messages: seen.append(messages) or "RENDERED")
    assert request.prompt == "RENDERED" and request.kind == "chat" and request.max_tokens == 128
    assert seen[0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("outcome, text, status, param, code", [
    (Outcome.QUEUE_FULL, "server busy: 1 requests running and 1 waiting, the queue (max_queue_size 1) is full",
     429, None, "server_busy"),
    (Outcome.SHUTTING_DOWN, "the deployment is being replaced", 503, None, "retry"),
    (Outcome.QUEUE_TIMEOUT, "waited 30 s for room", 503, None, "retry"),
    (Outcome.STEP_FAILED, "backbone engine failed", 503, None, "retry"),
    (Outcome.CONTEXT_LENGTH_EXCEEDED, "invalid request: prompt (600 tokens) + max_tokens (9) exceeds "
     "raw_context_limit 512", 400, "prompt", "context_length_exceeded"),
    (Outcome.BAD_REQUEST, "invalid request: max_tokens must be between 1 and 256, got 900", 400, "max_tokens", None),
    (Outcome.BAD_REQUEST, "invalid request: top_p must be in (0, 1], got 0.0", 400, "top_p", None),
    (Outcome.BAD_REQUEST, "invalid request: stop_words holds 40 words, at most 32", 400, "stop", None),
    (Outcome.BAD_REQUEST, "invalid request: text_input is empty", 400, "prompt", None),
    (Outcome.TOO_LARGE, "the request needs 900 KV slots, more than the whole cache", 400, None, "too_large"),
])
@pytest.mark.parametrize("wrapped", [False, True], ids=["as sent", "inside an ensemble's error"])
def test_a_deployments_error_maps_by_its_outcome_code(outcome, text, status, param, code, wrapped):
    message = tagged(outcome, text)
    if wrapped:
        message = f"in ensemble 'dualend', {message}"
    error = triton_error(message, parse_completion({"model": "m", "prompt": "x"}))
    assert (error.status, error.param, error.code) == (status, param, code)
    assert error.message == (f"in ensemble 'dualend', {text}" if wrapped else text)  # for people, without the code
    assert error.status == DISPOSITIONS[outcome].http_status


@pytest.mark.parametrize("message", [
    "server busy: the queue is full; retry later",  # our words without our code: not ours
    "[server_busy] a code that is not an outcome",
    "Stub process 'dualend_v1_postprocessing_0_0' is not healthy.",
    "Request for unknown model: 'dualend' is not found",
])
def test_an_error_without_an_outcome_code_is_tritonservers_own_and_retried(message):
    error = triton_error(message)
    assert (error.status, error.code, error.message) == (503, "retry", message)


def test_every_outcome_has_a_disposition_and_its_code_reads_back():
    for outcome in Outcome:
        assert outcome in DISPOSITIONS
        assert outcome_of(tagged(outcome, "x")) == (outcome, "x")
    assert outcome_of("x [queue_full] y") == (None, "x [queue_full] y")


def test_usage_carries_cached_tokens_and_latents_and_drafts_for_a_dual_end_deployment():
    cached = {"prompt_tokens_details": {"cached_tokens": 6}}
    assert usage(COUNTERS, False) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12} | cached
    assert usage(COUNTERS, True) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                     "prompt_latents": 4, "drafts": 3, "drafts_accepted": 2} | cached


def test_bodies_and_chunks_have_openais_shape():
    chat = parse_chat({"model": "llm", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "stream_options": {"include_usage": True}}, lambda m: "x")
    first = chunk_body(chat, "llm", "He", None, first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert chunk_body(chat, "llm", "", "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                 "finish_reason": "stop"}
    completion = parse_completion({"model": "dualend", "prompt": "x"})
    body = response_body(completion, "dualend", "abc", "length", usage(COUNTERS, False))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    assert body["id"].startswith("cmpl-")


def test_keys_are_hashed_compared_exactly_and_carry_a_cap(tmp_path):
    key = "a1" * 12
    (tmp_path / "keys").write_text(f"# clients\nalice {key} max_requests=2\nbob {'b2' * 12}\n")
    keys = read_keys(tmp_path / "keys")
    assert key not in repr(keys) and keys[key_hash(key)] == ApiKey("alice", key_hash(key), 2)
    assert client_of(f"Bearer {'b2' * 12}", keys).max_requests == 16
    for wrong in (f"Bearer {key.upper()}", f"BEARER {key}", f"bearer {key}", key, f"Bearer {key} ", None, "Bearer "):
        assert client_of(wrong, keys) is None, wrong
    (tmp_path / "bad").write_text(f"carol {key} max_requests=0\n")
    with pytest.raises(KeysFileError, match="max_requests=N"):
        read_keys(tmp_path / "bad")


def test_one_key_over_its_cap_is_refused_and_others_pass():
    caps, alice, bob = KeyCaps(), ApiKey("alice", "", 2), ApiKey("bob", "", 2)
    with caps.admit(alice), caps.admit(alice):
        with pytest.raises(ApiError) as refused:
            with caps.admit(alice):
                pass
        assert refused.value.status == 429 and "max_requests 2" in refused.value.message
        with caps.admit(bob):
            pass
    with caps.admit(alice):
        assert caps.in_flight["alice"] == 1


def test_a_request_whose_deployment_went_down_and_stalls_ends_even_after_the_mark_is_gone(tmp_path):
    marks = DownMarks(tmp_path)
    progress = Progress(marks, "dualend", stall_s=0.0)
    progress.check()  # up: waits as long as it takes
    (tmp_path / "dualend").touch()
    marks.poll()
    with pytest.raises(ApiError) as refused:
        marks.check_up("dualend")
    assert refused.value.status == 503
    (tmp_path / "dualend").unlink()
    marks.poll()
    marks.check_up("dualend")
    with pytest.raises(ApiError, match="retry") as ended:
        progress.check()
    assert ended.value.status == 503
    Progress(marks, "baseline", stall_s=0.0).check()  # another deployment's requests go on
    (tmp_path / "_server").touch()  # the watchdog's mark for all: a component cannot be restored
    marks.poll()
    with pytest.raises(ApiError):
        marks.check_up("baseline")


def test_a_streamed_request_silent_past_hang_s_ends_with_a_retry_whatever_the_marks_and_progress_resets_it(tmp_path):
    from test_batch_loop import FakeClock

    marks, clock = DownMarks(tmp_path), FakeClock()
    streamed = Progress(marks, "dualend", stall_s=1.0, hang_s=60.0, clock=clock)
    whole = Progress(marks, "dualend", stall_s=1.0, hang_s=None, clock=clock)  # one response at the end: no hang check
    clock.now = 59.0
    streamed.check()
    streamed.advanced()  # a response came
    clock.now = 119.0
    streamed.check()
    clock.now = 119.5
    with pytest.raises(ApiError, match="sent nothing for this request for 60 s") as ended:
        streamed.check()
    assert ended.value.status == 503 and ended.value.code == "retry"
    whole.check()


class ScriptedServer:
    """Answers ModelReady from `ready` (a name missing is not ready; `None` for all: the server does not
    answer) and counts the questions."""

    def __init__(self, ready):
        self.ready, self.asked = ready, []

    async def probe(self, name):
        self.asked.append(name)
        await asyncio.sleep(0)
        if self.ready is None:
            raise ConnectionError("failed to connect to all addresses")
        return name in self.ready


def test_readiness_is_asked_once_per_ttl_and_callers_meanwhile_share_the_answer():
    server, now = ScriptedServer({"dualend"}), [0.0]
    readiness = Readiness(server.probe, ttl_s=1.0, clock=lambda: now[0])

    async def ask_many():
        return await asyncio.gather(*(readiness.is_ready(name) for name in ["dualend"] * 5 + ["baseline"] * 5))

    assert asyncio.run(ask_many()) == [True] * 5 + [False] * 5
    assert sorted(server.asked) == ["baseline", "dualend"]
    server.ready = {"dualend", "baseline"}
    now[0] = 0.9
    assert not asyncio.run(readiness.is_ready("baseline")) and len(server.asked) == 2
    now[0] = 1.0
    assert asyncio.run(readiness.is_ready("baseline")) and len(server.asked) == 3


def test_a_server_that_does_not_say_whether_a_model_is_ready_is_a_503_retry():
    readiness = Readiness(ScriptedServer(None).probe)
    with pytest.raises(ApiError) as refused:
        asyncio.run(readiness.is_ready("dualend"))
    assert (refused.value.status, refused.value.code) == (503, "retry") and "failed to connect" in refused.value.message


def repository_of(root, *deployments):
    """Ensembles as the service finds them: each names its generation 1's first step."""
    for name in deployments:
        (root / name).mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'ensemble_scheduling {{ step [ {{ model_name: "{name}_v1_preprocessing" }} ] }}')
    return root


@pytest.mark.parametrize("ready, listed", [
    ({"dualend", "baseline", "smollm2"}, ["dualend", "baseline", "smollm2", "llm"]),
    ({"dualend", "smollm2"}, ["dualend", "smollm2"]),
    (set(), []),
])
def test_models_are_the_deployments_the_server_has_ready_and_the_canary_needs_both(tmp_path, ready, listed):
    from dualend.ops.openai_api.app import Service, ServiceSettings

    service = Service(ServiceSettings("127.0.0.1:1", repository_of(tmp_path, "dualend", "baseline", "smollm2")))
    service.readiness = Readiness(ScriptedServer(ready).probe)
    assert asyncio.run(service.served_models()) == listed


def test_a_deployment_not_loaded_is_a_404_that_says_so_and_one_being_restored_a_503(tmp_path):
    from dualend.ops.openai_api.app import Service, ServiceSettings

    service = Service(ServiceSettings("127.0.0.1:1", repository_of(tmp_path / "repository", "dualend", "baseline"),
                                      gateway_prefix=tmp_path / "gateway"))
    service.readiness = Readiness(ScriptedServer({"dualend"}).probe)

    def refusal(model):
        with pytest.raises(ApiError) as refused:
            asyncio.run(service.resolve(model))
        return refused.value

    assert asyncio.run(service.resolve("dualend")) == "dualend"
    for model in ("baseline", "llm"):
        error = refusal(model)
        assert (error.status, error.param, error.code) == (404, "model", "model_not_loaded")
        assert "not loaded" in error.message and "`baseline`" in error.message
    assert refusal("smollm2").code == "model_not_found"  # not in the repository at all
    (tmp_path / "gateway" / "down").mkdir(parents=True)
    (tmp_path / "gateway" / "down" / "baseline").touch()  # the watchdog restores it
    service.marks.poll()
    error = refusal("baseline")
    assert (error.status, error.code) == (503, "retry") and "restoring" in error.message


SMOLLM2_TEMPLATE = (  # the chat template in SmolLM2's tokenizer_config.json
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def served_repository(root, tiny_tokenizer, chat_template):
    """A repository as the service reads it: the `dualend` ensemble naming generation 1, whose
    preprocessing holds the exported tokenizer component (with a tokenizer config when `chat_template`)."""
    import json

    from tokenizers import Tokenizer

    (root / "dualend").mkdir(parents=True)
    (root / "dualend" / "config.pbtxt").write_text('ensemble_scheduling { step [ { model_name: "dualend_v1_preprocessing" } ] }')
    folder = root / "dualend_v1_preprocessing" / "1" / "tokenizer"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"settings": {"pair_size": 2}}))
    tokenizer = Tokenizer.from_str(tiny_tokenizer.to_json())
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    if chat_template:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<|im_end|>", "add_bos_token": False,
             "chat_template": chat_template}))
    return tokenizer


def test_a_three_turn_chat_renders_and_tokenizes_as_transformers_does(tmp_path, tiny_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from dualend.ops.openai_api.app import Service, ServiceSettings

    tokenizer = served_repository(tmp_path, tiny_tokenizer, SMOLLM2_TEMPLATE)
    service = Service(ServiceSettings("127.0.0.1:1", tmp_path))
    deployment = service.deployment("dualend")
    reference = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=SMOLLM2_TEMPLATE)
    history = []
    previous_ids = []
    for turn, (question, answer) in enumerate([("Q: 3+4", "7"), ("and minus 2?", "5"), ("twice that?", "10")]):
        history.append({"role": "user", "content": question})
        request = parse_chat({"model": "dualend", "messages": history}, deployment.render_chat)
        expected = reference.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert request.prompt == expected, turn
        ids = deployment.tokenizer.encode_prompt(request.prompt)
        assert ids == reference.apply_chat_template(history, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False)
        # the history is re-sent whole: the previous turn's prompt and answer are this prompt's start
        assert ids[:len(previous_ids)] == previous_ids
        history.append({"role": "assistant", "content": answer})
        previous_ids = deployment.tokenizer.encode(reference.apply_chat_template(history, tokenize=False))


def test_the_room_left_is_the_contracts_count_of_the_deployments_limits(tmp_path, tiny_tokenizer):
    from dataclasses import replace

    from test_control_and_config import CONFIG

    from dualend.ops.openai_api.app import Service, ServiceSettings
    from dualend.serving.contract import prepare_request, prompt_layout

    served_repository(tmp_path, tiny_tokenizer, SMOLLM2_TEMPLATE)
    history = [{"role": "user", "content": "Q: 3+4"}]
    unknown = Service(ServiceSettings("127.0.0.1:1", tmp_path)).deployment("dualend")
    prompt = unknown.render_chat(history)
    assert unknown.room(prompt) is None  # no mtp_verify config: nothing to fit
    _, slots = prompt_layout(unknown.tokenizer, unknown.tokenizer.encode_prompt(prompt), 2)
    (tmp_path / "dualend_v1_mtp_verify").mkdir()
    for max_new_tokens, room in ((256, 50), (30, 30)):  # what the context leaves, up to max_new_tokens
        config = replace(CONFIG, pipeline="dualend_v1", raw_context_limit=slots + 50, max_new_tokens=max_new_tokens)
        (tmp_path / "dualend_v1_mtp_verify" / "config.pbtxt").write_text(config.pbtxt())
        deployment = Service(ServiceSettings("127.0.0.1:1", tmp_path)).deployment("dualend")
        assert deployment.room(prompt) == room
        request = parse_chat({"model": "dualend", "messages": history}, deployment.render_chat, deployment.room)
        assert request.max_tokens == room  # under the default 128: what fits, and the contract takes it ...
        text_input = np.array([prompt.encode()], dtype=object)
        prepare_request(deployment.tokenizer, config.limits(), text_input=text_input,
                        max_tokens=np.array([room], dtype=np.int32))
        with pytest.raises(Exception, match="exceeds raw_context_limit|must be between 1 and 30"):  # ... not one more
            prepare_request(deployment.tokenizer, config.limits(), text_input=text_input,
                            max_tokens=np.array([room + 1], dtype=np.int32))


def test_chat_is_refused_naming_messages_without_a_template(tmp_path, tiny_tokenizer):
    from dualend.ops.openai_api.app import Service, ServiceSettings

    served_repository(tmp_path, tiny_tokenizer, None)
    deployment = Service(ServiceSettings("127.0.0.1:1", tmp_path)).deployment("dualend")
    with pytest.raises(ApiError) as refused:
        parse_chat({"model": "dualend", "messages": [{"role": "user", "content": "hi"}]}, deployment.render_chat)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "messages", "no_chat_template")
    assert deployment.dual_end


def test_refusals_worth_retrying_say_when_and_the_others_do_not(tmp_path, tiny_tokenizer):
    """Through the service's route: a key over its cap (429) and a deployment being restored (503) carry
    Retry-After; a malformed request (400) says nothing of retrying."""
    import json

    from starlette.requests import Request

    from dualend.ops.openai_api.app import Service, ServiceSettings

    served_repository(tmp_path / "repository", tiny_tokenizer, None)
    key = "a1" * 12
    (tmp_path / "keys").write_text(f"alice {key} max_requests=1\n")
    service = Service(ServiceSettings("127.0.0.1:1", tmp_path / "repository", keys_file=tmp_path / "keys",
                                      gateway_prefix=tmp_path / "gateway"))
    service.readiness = Readiness(ScriptedServer({"dualend"}).probe)

    def post(body):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(b"authorization", f"Bearer {key}".encode())]}

        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        return asyncio.run(service.generate(Request(scope, receive)))

    request = {"model": "dualend", "prompt": "Q: 1+1\nA:", "stream": True}
    with service.caps.admit(service.keys_file.keys[key_hash(key)]):  # alice's one place is taken
        over_cap = post(request)
    malformed = post(request | {"max_tokens": 0})
    (tmp_path / "gateway" / "down").mkdir(parents=True)
    (tmp_path / "gateway" / "down" / "dualend").touch()  # the watchdog restores it
    service.marks.poll()
    restoring = post(request)
    assert (over_cap.status_code, over_cap.headers["retry-after"]) == (429, "1")
    assert json.loads(over_cap.body)["error"]["code"] == "too_many_requests_for_key"
    assert (restoring.status_code, restoring.headers["retry-after"]) == (503, "2")
    assert json.loads(restoring.body)["error"]["code"] == "retry"
    assert malformed.status_code == 400 and "retry-after" not in malformed.headers


def test_a_triton_generate_body_gets_the_keys_name_as_client_and_salt_prefix_and_a_whole_answer_a_stream():
    from dualend.ops.openai_api.triton_routes import upstream_body

    def sent(body, whole=False, key="alice"):
        return json.loads(upstream_body(json.dumps(body).encode(), whole, key))

    assert sent({"text_input": "hi", "max_tokens": 4}) == {"text_input": "hi", "max_tokens": 4, "cache_salt": "alice/",
                                                          "client": "alice"}
    named = sent({"text_input": "hi", "cache_salt": "s", "client": "bob"})  # a client names no one but its key
    assert (named["cache_salt"], named["client"]) == ("alice/s", "alice")
    assert sent({"text_input": "hi", "cache_salt": ["s"]})["cache_salt"] == "alice/s"
    assert sent({"text_input": "hi", "stream": False}, whole=True)["stream"] is True  # the front joins the answer
    assert sent({"text_input": "hi", "stream": False}, key=None) == {"text_input": "hi", "stream": False}  # no keys
    for refused, param in ((b"not json", None), (b"[1, 2]", None), (b'{"x": "\xff"}', None),
                           (json.dumps({"text_input": "hi", "cache_salt": 7}).encode(), "cache_salt")):
        with pytest.raises(ApiError) as error:
            upstream_body(refused, False, "alice")
        assert error.value.status == 400 and error.value.param == param


@pytest.mark.parametrize("raw", [True, False])
def test_a_grpc_request_gets_the_keys_name_as_client_and_salt_prefix_in_its_own_layout(raw):
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

    from dualend.ops.openai_api.triton_routes import key_request

    request = service_pb2.ModelInferRequest(model_name="smollm2")
    given = {"text_input": np.array([b"hello"], dtype=object), "cache_salt": np.array([b"s"], dtype=object),
             "client": np.array([b"bob"], dtype=object), "max_tokens": np.array([4], dtype=np.int32)}
    for name, value in given.items():
        tensor = request.inputs.add(name=name, datatype=grpcclient.np_to_triton_dtype(value.dtype), shape=[1])
        if raw:
            request.raw_input_contents.append(serialize_byte_tensor(value).item() if value.dtype == object
                                              else value.tobytes())
        elif value.dtype == object:
            tensor.contents.bytes_contents.extend(value.tolist())
        else:
            tensor.contents.int_contents.extend(value.tolist())
    key_request(request, "alice")
    unsalted = service_pb2.ModelInferRequest(model_name="smollm2")
    unsalted.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    unsalted.raw_input_contents.append(serialize_byte_tensor(np.array([b"hi"], dtype=object)).item())
    key_request(unsalted, "alice")
    for sent, expected in ((request, {"text_input": b"hello", "cache_salt": b"alice/s", "client": b"alice"}),
                           (unsalted, {"text_input": b"hi", "cache_salt": b"alice/", "client": b"alice"})):
        for index, tensor in enumerate(sent.inputs):
            if tensor.name in expected:
                found = (deserialize_bytes_tensor(sent.raw_input_contents[index]).tolist() if sent.raw_input_contents
                         else list(tensor.contents.bytes_contents))
                assert found == [expected[tensor.name]] and tensor.datatype == "BYTES"
        assert {t.name for t in sent.inputs} >= set(expected)
    for sent in (request, unsalted):  # raw contents stay one per input when inputs are added
        assert len(sent.raw_input_contents) in (0, len(sent.inputs))


@pytest.mark.parametrize("raw", [True, False])
def test_a_grpc_request_that_wants_one_answer_is_told_apart_and_asked_as_a_stream(raw):
    from tritonclient.grpc import service_pb2

    from dualend.ops.openai_api.triton_routes import stream_it, streamed

    def request(stream):
        built = service_pb2.ModelInferRequest(model_name="smollm2")
        built.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        if raw:
            built.raw_input_contents.append(np.array([4], np.int32).tobytes())
        if stream is not None:
            tensor = built.inputs.add(name="stream", datatype="BOOL", shape=[1])
            if raw:
                built.raw_input_contents.append(np.array([stream]).tobytes())
            else:
                tensor.contents.bool_contents.append(stream)
        return built

    assert streamed(request(True)) and not streamed(request(False)) and not streamed(request(None))
    for wants_one in (request(False), request(None)):
        stream_it(wants_one)
        assert streamed(wants_one) and len(wants_one.raw_input_contents) in (0, len(wants_one.inputs))
