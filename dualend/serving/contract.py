"""The public request contract: a request's raw tensors validated into a PreparedRequest, and
the responses a decode loop sends back for it. No Triton import."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from dualend.engine.decode import MAX_STOP_WORDS, Chunk, ContextLengthExceeded, InvalidRequest, SamplingParams, pad_prompt
from dualend.engine.tokenizer import TextTokenizer

# The request's inputs with their Triton types: (type, dims, optional); the one declaration, rendered into
# the model configs by builder.assemble and read by the clients.
REQUEST_INPUT_TYPES = {
    "text_input": ("BYTES", (1,), False), "max_tokens": ("INT32", (1,), False), "stream": ("BOOL", (1,), True),
    "temperature": ("FP32", (1,), True), "top_k": ("INT32", (1,), True), "top_p": ("FP32", (1,), True),
    "random_seed": ("UINT64", (1,), True), "stop_words": ("BYTES", (-1,), True),
    "exclude_input_in_output": ("BOOL", (1,), True), "acceptance_threshold": ("FP32", (1,), True),
    "ignore_eos": ("BOOL", (1,), True), "cache_salt": ("BYTES", (1,), True), "client": ("BYTES", (1,), True)}
MAX_CACHE_SALT_CHARS = 512
MAX_CLIENT_CHARS = 128
REQUEST_INPUTS = tuple(REQUEST_INPUT_TYPES)  # prepare_request's
STEP_COUNTERS = ("num_output_tokens", "num_drafts", "num_accepted_drafts", "num_steps")  # per response, summed
REQUEST_COUNTERS = ("num_prompt_tokens", "num_prompt_latents", "num_cached_tokens")    # per request, repeated
COUNTERS = STEP_COUNTERS + REQUEST_COUNTERS  # every response's counter outputs (INT32 [1]), in this order


def config_tensors(names_and_types: dict[str, tuple[str, tuple[int, ...], bool]]) -> str:
    """config.pbtxt entries of an input or output list ("BYTES" is config.pbtxt's TYPE_STRING)."""
    return ",\n".join(f'  {{ name: "{name}" data_type: TYPE_{"STRING" if kind == "BYTES" else kind} '
                       f'dims: [ {", ".join(map(str, dims))} ]{" optional: true" if optional else ""} }}'
                       for name, (kind, dims, optional) in names_and_types.items())


def config_values() -> dict[str, str]:
    """The contract's parts of the model config templates: `${request_inputs}`, `${request_input_map}`,
    `${counter_outputs}`, `${counter_output_map}`."""
    counters = {name: ("INT32", (1,), False) for name in COUNTERS}
    return {"request_inputs": config_tensors(REQUEST_INPUT_TYPES), "counter_outputs": config_tensors(counters),
            "request_input_map": "\n".join(f'      input_map {{ key: "{n}" value: "{n}" }}' for n in REQUEST_INPUTS),
            "counter_output_map": "\n".join(f'      output_map {{ key: "{n}" value: "{n}" }}' for n in COUNTERS)}


@dataclass(frozen=True)
class Limits:
    raw_context_limit: int   # prompt + generated tokens, as the user counts them
    pair_size: int
    max_new_tokens: int

    @property
    def effective_latent_limit(self) -> int:
        return self.raw_context_limit // self.pair_size


@dataclass
class PreparedRequest:
    prompt_ids: list[int]    # BOS + prompt tokens, before pair padding
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    cache_salt: str = ""     # the prefix cache reuses only the KV of requests with the same salt
    client: str = ""         # who asks (the front sets its API key's name): the loop shares its steps by client
    turn_starts: list[int] = field(default_factory=list)  # a conversation's turns, paired one by one

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "PreparedRequest":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: dict) -> "PreparedRequest":
        raw = dict(raw)
        params = raw.pop("params")
        params["stop_words"] = tuple(params["stop_words"])
        return cls(params=SamplingParams(**params), **raw)

    def prompt_pairs(self, pair_size: int, pad_id: int) -> np.ndarray:
        """The prompt as the compressor reads it: [latents, pair_size] token ids, padded to pairs."""
        return np.asarray(pad_prompt(self.prompt_ids, pair_size, pad_id, self.turn_starts),
                          dtype=np.int64).reshape(-1, pair_size)


def prompt_layout(tokenizer: TextTokenizer, prompt_ids: list[int], pair_size: int) -> tuple[list[int], int]:
    """Where a pair model starts pairing a conversation's turns anew, and the context slots the
    prompt takes with that padding."""
    turn_starts = tokenizer.turn_starts(prompt_ids) if pair_size > 1 else []
    return turn_starts, len(pad_prompt(prompt_ids, pair_size, tokenizer.pad_id, turn_starts))


def new_token_room(tokenizer: TextTokenizer, limits: Limits, prompt_ids: list[int]) -> int:
    """The most new tokens a request with this prompt may ask for: what raw_context_limit leaves after
    it, up to max_new_tokens (below 1: none)."""
    _, slots = prompt_layout(tokenizer, prompt_ids, limits.pair_size)
    return min(limits.max_new_tokens, limits.raw_context_limit - slots)


def prepare_request(tokenizer: TextTokenizer, limits: Limits, *, text_input, max_tokens,
                    stream=None, temperature=None, top_k=None, top_p=None, random_seed=None,
                    stop_words=None, exclude_input_in_output=None, acceptance_threshold=None,
                    ignore_eos=None, cache_salt=None, client=None) -> PreparedRequest:
    """Validates one request's raw tensors (numpy arrays or None) into a PreparedRequest."""
    texts = np.asarray(text_input, dtype=object).reshape(-1)
    if texts.size != 1:
        raise InvalidRequest(f"text_input must hold exactly one string, got {texts.size}")
    raw_bytes = len(texts[0].encode() if isinstance(texts[0], str) else bytes(texts[0]))
    byte_limit = limits.raw_context_limit * tokenizer.max_token_bytes
    if raw_bytes > byte_limit:  # refused before tokenizing: a huge prompt costs nobody any time
        raise ContextLengthExceeded(
            f"prompt is {raw_bytes} bytes, longer than any prompt of raw_context_limit {limits.raw_context_limit} "
            f"tokens can be ({byte_limit} bytes); prompts are never truncated, shorten it")
    text = _text(texts[0], "text_input")
    if not text.strip():
        raise InvalidRequest("text_input is empty")
    params = SamplingParams(
        max_tokens=_scalar(max_tokens, "max_tokens", int),
        temperature=_scalar(temperature, "temperature", float) or 0.0,
        top_k=_scalar(top_k, "top_k", int) or 0,
        top_p=1.0 if top_p is None else _scalar(top_p, "top_p", float),
        seed=_scalar(random_seed, "random_seed", int) or 0,
        acceptance_threshold=_scalar(acceptance_threshold, "acceptance_threshold", float),
        stop_words=_stop_words(stop_words),
        ignore_eos=bool(_scalar(ignore_eos, "ignore_eos", int) or False),
    )
    if params.max_tokens is None:  # max_tokens is checked here only: later steps trust it
        raise InvalidRequest("max_tokens is required")
    if not 1 <= params.max_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_tokens must be between 1 and {limits.max_new_tokens}, got {params.max_tokens}")
    params.validate()
    prompt_ids = tokenizer.encode_prompt(text)
    turn_starts, prompt_slots = prompt_layout(tokenizer, prompt_ids, limits.pair_size)
    counted = (f"{len(prompt_ids)} tokens" if prompt_slots == len(prompt_ids)
               else f"{len(prompt_ids)} tokens, {prompt_slots} slots with the pair padding")
    if prompt_slots >= limits.raw_context_limit:
        raise ContextLengthExceeded(
            f"prompt is {counted}, leaving no room for a new token within raw_context_limit "
            f"{limits.raw_context_limit} ({limits.effective_latent_limit} latents); prompts are never truncated, "
            "shorten it")
    if prompt_slots + params.max_tokens > limits.raw_context_limit:
        raise ContextLengthExceeded(
            f"prompt ({counted}) + max_tokens ({params.max_tokens}) exceeds raw_context_limit "
            f"{limits.raw_context_limit}; lower max_tokens to at most {limits.raw_context_limit - prompt_slots}")
    salt = "" if cache_salt is None else _text(np.asarray(cache_salt, dtype=object).reshape(-1)[0], "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt is {len(salt)} characters long, at most {MAX_CACHE_SALT_CHARS}")
    who = "" if client is None else _text(np.asarray(client, dtype=object).reshape(-1)[0], "client")
    if len(who) > MAX_CLIENT_CHARS:
        raise InvalidRequest(f"client is {len(who)} characters long, at most {MAX_CLIENT_CHARS}")
    return PreparedRequest(prompt_ids, params, bool(_scalar(stream, "stream", int) or False),
                           bool(_scalar(exclude_input_in_output, "exclude_input_in_output", int) or False), salt,
                           who, turn_starts)


def _scalar(value, name: str, kind):
    if value is None:
        return None
    array = np.asarray(value).reshape(-1)
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got {array.size}")
    item = array[0].item()
    if kind is float and not isinstance(item, (int, float)) or kind is int and not isinstance(item, int):
        raise InvalidRequest(f"{name} must be a number, got {type(item).__name__}")
    return kind(item)


def _text(value: bytes | str, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(f"{name} is not valid UTF-8 (bad byte at offset {error.start})") from None


def _stop_words(value) -> tuple[str, ...]:
    if value is None:
        return ()
    words = np.asarray(value, dtype=object).reshape(-1)
    if words.size > MAX_STOP_WORDS:  # counted before any is decoded
        raise InvalidRequest(f"stop_words holds {words.size} words, at most {MAX_STOP_WORDS}")
    return tuple(_text(word, "stop_words") for word in words)


@dataclass
class Response:
    output_ids: list[int]
    counters: dict[str, int]
    finish_reason: str | None

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"output_ids": np.asarray(self.output_ids, dtype=np.int64)}
        out.update({name: np.asarray([value], dtype=np.int32) for name, value in self.counters.items()})
        out["finish_reason"] = np.asarray([(self.finish_reason or "").encode()], dtype=object)
        return out


def merge_counters(total: dict[str, int], piece: dict[str, int]) -> None:
    """Adds one streamed response's counters into a request's running totals."""
    for name in STEP_COUNTERS:
        total[name] = total.get(name, 0) + piece.get(name, 0)
    for name in REQUEST_COUNTERS:
        total[name] = piece.get(name, total.get(name, 0))


class ResponseStream:
    """One request's chunks -> its responses: one per chunk when streaming, otherwise one with
    everything when the last chunk arrives. The prompt, unless excluded, leads the first response;
    it is not counted as output."""

    def __init__(self, request: PreparedRequest, num_prompt_latents: int):
        self.stream = request.stream
        self.prompt_echo = [] if request.exclude_input_in_output else list(request.prompt_ids)
        self.fixed = {"num_prompt_tokens": len(request.prompt_ids), "num_prompt_latents": num_prompt_latents,
                      "num_cached_tokens": 0}  # prompt tokens whose KV a prefix-cache hit reused
        self.total = Response([], dict.fromkeys(STEP_COUNTERS, 0) | self.fixed, None)

    def cached(self, tokens: int) -> None:
        """How many prompt tokens' KV a prefix-cache hit reused (known when its prefill starts)."""
        self.fixed["num_cached_tokens"] = self.total.counters["num_cached_tokens"] = tokens

    def add(self, chunk: Chunk) -> Response | None:
        part = {"num_output_tokens": len(chunk.tokens), "num_drafts": chunk.drafts,
                "num_accepted_drafts": chunk.accepted, "num_steps": chunk.steps}
        if self.stream:
            response = Response(self.prompt_echo + chunk.tokens, part | self.fixed, chunk.finish_reason)
            self.prompt_echo = []
            return response
        self.total.output_ids += chunk.tokens
        self.total.counters = {k: self.total.counters[k] + part.get(k, 0) for k in self.total.counters}
        if chunk.finish_reason is None:
            return None
        self.total.finish_reason = chunk.finish_reason
        self.total.output_ids = self.prompt_echo + self.total.output_ids
        return self.total
