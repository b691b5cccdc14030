"""OpenAI's request and response shapes <-> the deployments' Triton request contract (README.md).

Pure functions, no I/O: a `/v1/completions` or `/v1/chat/completions` body becomes a `Generation`
(checked field by field, a wrong one refused naming it), a Generation becomes the ensemble's inputs,
and Triton's counters and finish reasons become OpenAI's bodies, chunks and usage. Every refusal is an
`ApiError` in OpenAI's error shape; `triton_error` maps a deployment's error to the status a client
retries on by the outcome code it carries (dualend.serving.outcomes), never by its words.
"""
from __future__ import annotations

import difflib
import json
import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from dualend.serving.contract import MAX_CACHE_SALT_CHARS
from dualend.serving.outcomes import DISPOSITIONS, Outcome, disposition, tagged

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}  # OpenAI's for completions; chat's: at most what fits
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
TRITON_FIELDS = {"text_input": "prompt", "random_seed": "seed", "stop_words": "stop", "max_tokens": "max_tokens",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}  # Triton input -> OpenAI field
IGNORED = {"user", "service_tier", "store", "metadata", "parallel_tool_calls", "tool_choice", "prompt_cache_key",
           "safety_identifier"}  # accepted and without effect on an answer, as other servers do
READ = {"model", "n", "best_of", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
        "stop", "temperature", "top_p", "top_k", "seed", "ignore_eos",
        "cache_salt"}  # both routes'; with the prompt's field and NEUTRAL's, every other one is refused
PROMPT_FIELD = {"completions": "prompt", "chat": "messages"}
# fields this server cannot honour, accepted only at a value that changes nothing, the first one named in the
# refusal (clients send them so: `vllm bench serve` repetition_penalty 1.0, LangChain's completions the penalties 0)
_OFF = (False, 0, [], {"type": "text"})
NEUTRAL = {"logprobs": _OFF, "top_logprobs": (0, *_OFF), "tools": ([], *_OFF), "functions": ([], *_OFF),
           "response_format": ({"type": "text"}, *_OFF), "echo": _OFF, "presence_penalty": (0,),
           "frequency_penalty": (0,), "logit_bias": ({},), "suffix": ("",), "repetition_penalty": (1,), "min_p": (0,)}
# Retry-After (seconds) on the refusals a client retries, by status (outcomes.DISPOSITIONS): a 429's place
# frees as soon as one request ends; a 503's failed step is restored, or its server answers again, in seconds
RETRY_AFTER_S = {d.http_status: d.retry_after_s for d in DISPOSITIONS.values() if d.retry_after_s}
MAX_JSON_DEPTH = 32  # OpenAI's bodies nest 4 deep (messages[i].content[j].text)


class ApiError(Exception):
    """A refusal in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, outcome: Outcome | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s if retry_after_s is not None else RETRY_AFTER_S.get(status)
        self.outcome = outcome

    @classmethod
    def of(cls, outcome: Outcome, message: str, retry_after_s: int | None = None) -> "ApiError":
        """A refusal of the front's own, decided by its outcome's disposition on every route."""
        found = DISPOSITIONS[outcome]
        return cls(found.http_status, message, None, found.openai_code,
                   retry_after_s if retry_after_s is not None else found.retry_after_s, outcome)

    def triton_message(self) -> str:
        """The message as Triton's routes carry it: the outcome's code at its head, when it has one."""
        return tagged(self.outcome, self.message) if self.outcome else self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After on a refusal worth retrying (429, 503, or as given); none on the others."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


@dataclass
class Generation:
    """One request, as the ensemble takes it."""
    kind: str                     # "completions" or "chat"
    model: str
    prompt: str
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None      # vLLM's extension
    seed: int | None = None       # sampling without one: a seed of its own (greedy: none, the contract's 0)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False      # our extension, for benchmarks (as vLLM's)
    cache_salt: str = ""          # the prefix cache's partition: the API key's name, or the body's (vLLM's)
    client: str = ""              # the API key's name: the decode loop shares its steps by client
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse_body(body: bytes) -> dict:
    """A request body as a JSON object whose every string is valid text, or an ApiError naming what
    is wrong: not UTF-8 JSON, not an object, nested past MAX_JSON_DEPTH, a string (or key) holding a
    lone UTF-16 surrogate (JSON's "\\ud800" escape), which no tokenizer can encode."""
    try:
        parsed = json.loads(body)
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # UnicodeDecodeError too
        raise ApiError(400, "the request body is not JSON (UTF-8 text)") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the request body must be a JSON object")
    pending = [(parsed, "", 1, None)]  # (value, its path, its depth, the top-level field it sits in)
    while pending:
        value, where, depth, field_name = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels, at `{where}`",
                           field_name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            path = f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}" if where else key
            top = field_name if where else key
            if any(isinstance(text, str) and not _encodable(text) for text in (key, item)):
                shown = path.encode("utf-8", "backslashreplace").decode()
                raise ApiError(400, f"`{shown}` is not valid text: it holds a lone UTF-16 surrogate",
                               top if _encodable(top) else None)
            if isinstance(item, (dict, list)):
                pending.append((item, path, depth + 1, top))
    return parsed


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"`{name}` must be a number between {low:g} and {high:g}, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"`{name}` must be an integer between {low} and {high}, got {value!r}", name)
    return value


def _cache_salt(body: dict) -> str:
    salt, longest = body.get("cache_salt", ""), MAX_CACHE_SALT_CHARS // 2  # the rest: room for the key's name
    if not isinstance(salt, str) or len(salt) > longest:
        raise ApiError(400, f"`cache_salt` must be a string of at most {longest} characters", "cache_salt")
    return salt


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"`{name}` must be true or false, got {value!r}", name)
    return value


def _common(body: object, kind: str) -> dict:
    """The fields both routes share, checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name in NEUTRAL:
            if body[name] is not None and body[name] not in NEUTRAL[name]:
                raise ApiError(400, f"`{name}` is not supported by this server (only {json.dumps(NEUTRAL[name][0])}, "
                                    "which changes nothing)", name)
        elif name not in READ | IGNORED | {PROMPT_FIELD[kind]}:
            close = difflib.get_close_matches(name, sorted(READ | {PROMPT_FIELD[kind]}), n=1)
            raise ApiError(400, f"`{name}` is not a field of /v1/{kind.replace('chat', 'chat/completions')}"
                                + (f" (did you mean `{close[0]}`?)" if close else ""), name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required: the name of a deployment (GET /v1/models lists them)", "model")
    choices = body.get("n", 1)
    if isinstance(choices, bool) or choices not in (1, None):
        raise ApiError(400, f"`n` must be 1 (one choice per request), got {choices!r}", "n")
    if body.get("best_of", 1) not in (1, None):
        raise ApiError(400, "`best_of` must be 1", "best_of")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "`stream_options` must be an object, and only with `stream`: true", "stream_options")
    include_usage = options is not None and _flag(options, "include_usage")
    max_tokens = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 2**31 - 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(word, str) and word for word in stop):
        raise ApiError(400, "`stop` must be a non-empty string or a list of them", "stop")
    top_k = _integer(body, "top_k", -1, 2**31 - 1)  # -1 or 0: off, as vLLM
    seed, temperature = _integer(body, "seed", 0, 2**64 - 1), _number(body, "temperature", 0, 2)
    if seed is None and temperature:  # OpenAI's clients expect a fresh sample from each request
        seed = secrets.randbits(63)
    return dict(kind=kind, model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                min_tokens=_integer(body, "min_tokens", 0, 2**31 - 1), temperature=temperature,
                top_p=_number(body, "top_p", 0, 1), top_k=top_k if top_k and top_k > 0 else None, seed=seed,
                stop=stop, ignore_eos=_flag(body, "ignore_eos"), cache_salt=_cache_salt(body))


def _generation(prompt: str, fields: dict, default_max_tokens: int) -> Generation:
    """The request with its max_tokens settled (the client's, else `default_max_tokens`): `min_tokens`
    holds only where every answer is that long."""
    given, min_tokens = fields["max_tokens"] is not None, fields.pop("min_tokens")
    fields["max_tokens"] = fields["max_tokens"] if given else default_max_tokens
    if min_tokens and not (fields["ignore_eos"] and not fields["stop"] and min_tokens <= fields["max_tokens"]):
        raise ApiError(400, "`min_tokens` is honoured only with `ignore_eos`: true, no `stop` and at most max_tokens "
                            f"({fields['max_tokens']}{'' if given else ', the default here'}): every answer is then "
                            "max_tokens long", "min_tokens")
    return Generation(prompt=prompt, **fields)


def parse_completion(body: object) -> Generation:
    fields = _common(body, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "`prompt` must be one non-empty string (token ids and batches of prompts are not "
                            "served)", "prompt")
    return _generation(prompt, fields, DEFAULT_MAX_TOKENS["completions"])


def chat_messages(body: dict) -> list[dict]:
    """`messages` checked and their content flattened to text: [{"role", "content"}]."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of {role, content}", "messages")
    flat = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"`{where}.role` must be system, developer, user or assistant", f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"`{where}.content` parts must all be {{type: text, text}}", f"{where}.content")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ApiError(400, f"`{where}.content` must be a string or a list of text parts", f"{where}.content")
        flat.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return flat


def parse_chat(body: object, render, room=None) -> Generation:
    """`render(messages) -> prompt text`: the model's chat template (raises ApiError without one);
    `room(prompt) -> tokens` that fit after the prompt: without max_tokens, the default is cut to them,
    so that a conversation grown near the context limit is still answered."""
    fields = _common(body, "chat")
    prompt = render(chat_messages(body))
    fits = room(prompt) if room and fields["max_tokens"] is None else None
    return _generation(prompt, fields, max(1, min(DEFAULT_MAX_TOKENS["chat"], math.inf if fits is None else fits)))


def triton_inputs(request: Generation) -> dict[str, np.ndarray]:
    """The ensemble's inputs (README's contract), streamed: the front keeps the connection's end."""
    inputs = {"text_input": np.array([request.prompt.encode()], dtype=object),
              "max_tokens": np.array([request.max_tokens], dtype=np.int32),
              "stream": np.array([True]), "exclude_input_in_output": np.array([True])}
    if request.temperature is not None:
        inputs["temperature"] = np.array([request.temperature], dtype=np.float32)
    if request.top_p is not None:
        inputs["top_p"] = np.array([request.top_p], dtype=np.float32)
    if request.top_k is not None:
        inputs["top_k"] = np.array([request.top_k], dtype=np.int32)
    if request.seed is not None:
        inputs["random_seed"] = np.array([request.seed], dtype=np.uint64)
    if request.ignore_eos:
        inputs["ignore_eos"] = np.array([True])
    if request.stop:
        inputs["stop_words"] = np.array([w.encode() for w in request.stop], dtype=object)
    if request.cache_salt:
        inputs["cache_salt"] = np.array([request.cache_salt.encode()], dtype=object)
    if request.client:
        inputs["client"] = np.array([request.client.encode()], dtype=object)
    return inputs


def triton_error(message: str, request: Generation | None = None) -> ApiError:
    """The deployment's error as an ApiError: status and code by its outcome (outcomes.DISPOSITIONS),
    an untagged one being tritonserver's own (503, retry). A 400 names the OpenAI field the message
    is about, for people; the message goes on without the code."""
    outcome, found, text = disposition(message)
    param = None
    if found.http_status == 400:
        prompt_field = "messages" if request is not None and request.kind == "chat" else "prompt"
        if outcome == Outcome.CONTEXT_LENGTH_EXCEEDED or re.match(r"(prompt|text_input)\b",
                                                                   text.rpartition("invalid request: ")[2]):
            param = prompt_field
        else:
            named = next((f for triton, f in TRITON_FIELDS.items() if re.search(rf"\b{triton}\b", text)), None)
            param = prompt_field if named == "prompt" else named
    return ApiError(found.http_status, text, param, found.openai_code, outcome=outcome)


def usage(counters: dict[str, int], dual_end: bool) -> dict:
    """OpenAI's usage, plus the prompt latents and drafts for a dual-end deployment."""
    body = {"prompt_tokens": counters["num_prompt_tokens"], "completion_tokens": counters["num_output_tokens"],
            "total_tokens": counters["num_prompt_tokens"] + counters["num_output_tokens"],
            "prompt_tokens_details": {"cached_tokens": counters.get("num_cached_tokens", 0)}}
    if dual_end:
        body |= {"prompt_latents": counters["num_prompt_latents"], "drafts": counters["num_drafts"],
                 "drafts_accepted": counters["num_accepted_drafts"]}
    return body


def finish_reason(triton_reason: str) -> str | None:
    return FINISH_REASONS.get(triton_reason, triton_reason or None)


def _choice(request: Generation, text: str, reason: str | None, delta: bool) -> dict:
    if request.kind == "completions":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if delta:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}


def _envelope(request: Generation, served_model: str, chunk: bool) -> dict:
    kind = "text_completion" if request.kind == "completions" else "chat.completion" + (".chunk" if chunk else "")
    prefix = "cmpl" if request.kind == "completions" else "chatcmpl"
    return {"id": f"{prefix}-{request.id}", "object": kind, "created": request.created, "model": served_model}


def response_body(request: Generation, served_model: str, text: str, reason: str | None, usage_body: dict) -> dict:
    return _envelope(request, served_model, False) | {"choices": [_choice(request, text, reason, False)],
                                                     "usage": usage_body}


def chunk_body(request: Generation, served_model: str, text: str, reason: str | None, first: bool = False) -> dict:
    choice = _choice(request, text, reason, True)
    if first and request.kind == "chat":
        choice["delta"] = {"role": "assistant", "content": text}
    body = _envelope(request, served_model, True) | {"choices": [choice]}
    if request.include_usage:
        body["usage"] = None
    return body


def usage_chunk(request: Generation, served_model: str, usage_body: dict) -> dict:
    return _envelope(request, served_model, True) | {"choices": [], "usage": usage_body}
