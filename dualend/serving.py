"""Serving logic with no Triton import: request validation and the shape of responses.

The Triton models in model_repository/ are thin adapters over these functions.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
import numpy as np

from .decode import MAX_STOP_WORDS, Chunk, InvalidRequest, SamplingParams, pad_prompt
from .onnx_engine import ExportedModel
from .tokenizer import TextTokenizer

COUNTERS = ("num_output_tokens", "num_drafts", "num_accepted_drafts", "num_steps",
            "num_prompt_tokens", "num_prompt_latents")


class ModelParameters(dict):
    """A model config's `parameters`; a missing one names itself and the way to fix it."""

    def __init__(self, model: str, values: dict[str, str]):
        super().__init__(values)
        self.model = model

    def __missing__(self, key: str) -> str:
        raise KeyError(f"{self.model}: the model config has no parameter {key!r}: the repository was built by "
                       f"another version of dualend; rebuild it with `python -m builder.assemble`")


def model_parameters(args: dict) -> ModelParameters:
    """The `parameters` of a Triton model's config, from the args of its initialize()."""
    config = json.loads(args["model_config"])
    return ModelParameters(args.get("model_name", config.get("name", "model")),
                           {k: v["string_value"] for k, v in config.get("parameters", {}).items()})


PIPELINE_SECRET_ENV = "DUALEND_PIPELINE_SECRET"
PIPELINE_SECRET_FILE = "pipeline_secret"  # in the repository root, written by builder.assemble
NOT_FROM_PIPELINE = ("refused: {model} is an internal step of the {deployment} pipeline (or this request comes "
                     "from a step of another checkpoint); send requests to the `{deployment}` model")


def pipeline_secret(args: dict, checkpoint_id: str) -> str:
    """What the models of one pipeline share and clients do not: the launcher's per-start secret
    ($DUALEND_PIPELINE_SECRET), else the one builder.assemble wrote into the repository, bound to
    the checkpoint, so a step also refuses requests from a step of another checkpoint."""
    secret = os.environ.get(PIPELINE_SECRET_ENV)
    if secret:
        return pipeline_key(secret, checkpoint_id)
    path = Path(args["model_repository"]).parent / PIPELINE_SECRET_FILE
    if not path.exists():
        raise RuntimeError(f"no pipeline secret: set ${PIPELINE_SECRET_ENV} or assemble the repository again "
                           f"(python -m builder.assemble writes {PIPELINE_SECRET_FILE})")
    return pipeline_key(path.read_text().strip(), checkpoint_id)


def pipeline_key(secret: str, checkpoint_id: str) -> str:
    return f"{secret}:{checkpoint_id}"


def request_token(secret: str, request_params: bytes) -> str:
    """The `pipeline_key` preprocessing hands the compressor with a request: an HMAC of the request
    parameters it wrote. Preprocessing answers clients too (it is the ensemble's first step), so it
    never hands out the secret itself; a client that calls it gets a token for parameters
    preprocessing wrote, which the compressor takes only with that prompt's tokens."""
    return hmac.new(secret.encode(), b"request\0" + request_params, hashlib.sha256).hexdigest()


def latents_token(secret: str, request_params: bytes, latents: np.ndarray) -> str:
    """The `pipeline_key` the compressor hands mtp_verify: an HMAC of the parameters and of the prompt
    latents it computed from their prompt, so mtp_verify decodes no latents a client made up."""
    latents = np.ascontiguousarray(latents, dtype=np.float32)
    message = b"latents\0%d\0%s\0" % (len(request_params), ",".join(map(str, latents.shape)).encode())
    return hmac.new(secret.encode(), message + request_params + latents.tobytes(), hashlib.sha256).hexdigest()


def response_token(secret: str, request_id: int, output_ids: np.ndarray) -> str:
    """The `pipeline_key` mtp_verify hands postprocessing with each response: an HMAC of the request
    id and the token ids, so postprocessing detokenizes (and relays a cancel for) only what the
    pipeline's own decode loop sent; clients never see it (the ensemble does not output it)."""
    ids = np.ascontiguousarray(output_ids, dtype=np.int64)
    return hmac.new(secret.encode(), b"response\0%d\0" % request_id + ids.tobytes(), hashlib.sha256).hexdigest()


class PipelineGuard:
    """An internal step's check that a request comes from its own pipeline: the same server start
    and the same checkpoint. Steps calling each other (mtp_verify -> backbone, postprocessing's
    cancel, the launcher's drain) present the secret; along the ensemble each step presents the
    token its predecessor made for the very data it passes on (`request_token`, `latents_token`,
    `response_token`)."""

    def __init__(self, args: dict, checkpoint_id: str, deployment: str):
        self.secret = pipeline_secret(args, checkpoint_id)
        self.refusal = NOT_FROM_PIPELINE.format(model=args["model_name"], deployment=deployment)

    def refuses(self, key, token: str | None = None) -> str | None:
        """The refusal message for a request whose `pipeline_key` input (None when absent) is neither
        the pipeline's secret nor `token`, the token this step expects for the data it was given;
        None for one from the pipeline."""
        given = _key_bytes(key)
        if given is not None and (hmac.compare_digest(given, self.secret.encode())
                                  or token is not None and hmac.compare_digest(given, token.encode())):
            return None
        return self.refusal


def _key_bytes(key) -> bytes | None:
    """A `pipeline_key` input's one value as bytes; None when absent or not one value."""
    if key is None:
        return None
    value = np.asarray(key, dtype=object).reshape(-1)
    if value.size != 1:
        return None
    return value[0].encode() if isinstance(value[0], str) else bytes(value[0])


def pipeline_name(deployment: str, generation: int) -> str:
    return f"{deployment}_v{generation}"


def generation_of(model: str, deployment: str) -> int | None:
    """The generation of one of the deployment's internal models (`dualend_v3_backbone` -> 3), None
    for any other name (the ensemble itself, another deployment's models)."""
    match = re.fullmatch(rf"{re.escape(deployment)}_v(\d+)_\w+", model)
    return int(match.group(1)) if match else None


def served_generation(repository: Path, deployment: str) -> int | None:
    """The generation of internal models the deployment's ensemble uses, None if there is none."""
    config = repository / deployment / "config.pbtxt"
    match = re.search(r'model_name: "(\w+)"', config.read_text()) if config.exists() else None
    return generation_of(match.group(1), deployment) if match else None


def generations(repository: Path, deployment: str) -> list[int]:
    return sorted({g for p in repository.glob(f"{deployment}_v*_*")
                   if (g := generation_of(p.name, deployment)) is not None})


def prune_generations(repository: Path, deployment: str, keep: set[str], keep_newer_than: int | None = None
                      ) -> list[str]:
    """Removes the folders of the deployment's generations not in `keep` (pipeline names) and, with
    `keep_newer_than`, not newer than that generation (one assembled meanwhile stays); returns the
    pipelines removed. Only for generations no server has loaded."""
    removed = []
    for generation in generations(repository, deployment):
        pipeline = pipeline_name(deployment, generation)
        if pipeline not in keep and (keep_newer_than is None or generation <= keep_newer_than):
            for folder in repository.glob(f"{pipeline}_*"):
                shutil.rmtree(folder, ignore_errors=True)
            removed.append(pipeline)
    return removed


def version_components(args: dict, names: tuple[str, ...]) -> ExportedModel:
    """The verified components that sit in a Triton model's version folder."""
    return ExportedModel.open(Path(args["model_repository"]) / args["model_version"], names)


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
        return np.asarray(pad_prompt(self.prompt_ids, pair_size, pad_id), dtype=np.int64).reshape(-1, pair_size)


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


def prepare_request(tokenizer: TextTokenizer, limits: Limits, *, text_input, max_tokens,
                    stream=None, temperature=None, top_k=None, top_p=None, random_seed=None,
                    stop_words=None, exclude_input_in_output=None, acceptance_threshold=None,
                    ignore_eos=None) -> PreparedRequest:
    """Validates one request's raw tensors (numpy arrays or None) into a PreparedRequest."""
    texts = np.asarray(text_input, dtype=object).reshape(-1)
    if texts.size != 1:
        raise InvalidRequest(f"text_input must hold exactly one string, got {texts.size}")
    raw_bytes = len(texts[0].encode() if isinstance(texts[0], str) else bytes(texts[0]))
    byte_limit = limits.raw_context_limit * tokenizer.max_token_bytes
    if raw_bytes > byte_limit:  # refused before tokenizing: a huge prompt costs nobody any time
        raise InvalidRequest(
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
    if params.max_tokens is None:
        raise InvalidRequest("max_tokens is required")
    params.validate(limits.max_new_tokens)
    prompt_ids = tokenizer.encode_prompt(text)
    prompt_slots = len(pad_prompt(prompt_ids, limits.pair_size, tokenizer.pad_id))
    counted = (f"{len(prompt_ids)} tokens" if prompt_slots == len(prompt_ids)
               else f"{len(prompt_ids)} tokens, {prompt_slots} slots with the pair padding")
    if prompt_slots >= limits.raw_context_limit:
        raise InvalidRequest(
            f"prompt is {counted}, leaving no room for a new token within raw_context_limit "
            f"{limits.raw_context_limit} ({limits.effective_latent_limit} latents); prompts are never truncated, "
            "shorten it")
    if prompt_slots + params.max_tokens > limits.raw_context_limit:
        raise InvalidRequest(
            f"prompt ({counted}) + max_tokens ({params.max_tokens}) exceeds raw_context_limit "
            f"{limits.raw_context_limit}; lower max_tokens to at most {limits.raw_context_limit - prompt_slots}")
    return PreparedRequest(prompt_ids, params, bool(_scalar(stream, "stream", int) or False),
                           bool(_scalar(exclude_input_in_output, "exclude_input_in_output", int) or False))


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


class ResponseStream:
    """One request's chunks -> its responses: one per chunk when streaming, otherwise one with
    everything when the last chunk arrives. The prompt, unless excluded, leads the first response;
    it is not counted as output."""

    def __init__(self, request: PreparedRequest, num_prompt_latents: int):
        self.stream = request.stream
        self.prompt_echo = [] if request.exclude_input_in_output else list(request.prompt_ids)
        self.fixed = {"num_prompt_tokens": len(request.prompt_ids), "num_prompt_latents": num_prompt_latents}
        self.total = Response([], {name: 0 for name in COUNTERS[:4]} | self.fixed, None)

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
