"""The OpenAI-compatible service: an ASGI app (Starlette, served by uvicorn) in front of tritonserver's
gRPC streaming endpoint, behind the gateway (nginx routes /v1/ here).

    GET  /v1/models                         the deployments tritonserver has ready, and the canary `llm`
    POST /v1/completions                    prompt -> text; `stream` for SSE chunks ending `data: [DONE]`
    POST /v1/chat/completions               messages -> the checkpoint's chat template -> text
    GET  /metrics                           tokens by API key name (Prometheus), on the service's own port
    GET  /health                            200 while the service runs (the launcher's check)

Every request is one gRPC stream to the deployment's ensemble (streamed internally either way, so the
front sees progress): a client that disconnects cancels it, which frees its KV; a request whose
deployment is marked down by the watchdog and makes no progress ends with 503 / an error event "retry".
A deployment is a model here while tritonserver has its ensemble loaded and ready (asked at most once a
second); one in the repository but not loaded is refused with 404, or 503 while the watchdog restores it.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dualend.engine.tokenizer import TextTokenizer
from dualend.serving.contract import COUNTERS, Limits, merge_counters, new_token_room
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import (CANARY_MODEL, CANARY_PAIR, PUBLIC_DEPLOYMENTS, pipeline_name, served_config,
                                        served_deployments, served_generation)

from ..api_keys import ApiKey, KeysFile, client_of, keyed_salt
from ..host import TO_LOCAL_SERVER, UNLIMITED_MESSAGES
from ..usage import UsageStore, seconds_to_next_day
from .front import ClientGone, DisconnectAwareStream, DownMarks, KeyCaps, Progress, Readiness, unless_gone
from .triton_routes import GrpcFront, HttpGenerate
from .translation import (ApiError, Generation, chunk_body, finish_reason, parse_body, parse_chat,
                          parse_completion, response_body, triton_error, triton_inputs, usage, usage_chunk)

TICK_S = 0.1  # how often a waiting request checks its deployment's marks
READY_TTL_S = 1.0  # how long tritonserver's answer on whether a deployment is ready is reused
READY_TIMEOUT_S = 2.0


@dataclass
class ServiceSettings:
    triton_grpc: str                       # host:port of tritonserver's own gRPC endpoint
    model_repository: Path
    host: str = "127.0.0.1"
    port: int = 18080
    keys_file: Path | None = None          # api_keys lines; None: anyone, as `anonymous`, no cap or quota
    gateway_prefix: Path | None = None     # the watchdog's down marks and the canary weight live there
    baseline_percent: float = 10.0         # the canary's share, unless the gateway's settings say otherwise
    stall_s: float = 1.0                   # no response this long while the deployment is (was) down: 503
    hang_s: float = 60.0                   # no response this long to a streamed request, whatever the marks: 503
    max_body_bytes: int = 1 << 20
    usage_db: Path | None = None           # tokens per key and day (dualend.ops.usage); None: not kept
    triton_http: str | None = None         # host:port of tritonserver's HTTP endpoint: the generate routes here
    grpc_port: int | None = None           # Triton's gRPC InferenceService, fronted here; None: not fronted


@dataclass
class Deployment:
    name: str
    pair_size: int
    tokenizer: TextTokenizer | None       # None without a chat template
    limits: Limits | None = None          # the request contract's; None: not found, nothing fitted to them

    @property
    def dual_end(self) -> bool:
        return self.pair_size > 1

    def room(self, prompt: str) -> int | None:
        """The most new tokens a request with `prompt` may ask for (the contract's count)."""
        if self.tokenizer is None or self.limits is None:
            return None
        return new_token_room(self.tokenizer, self.limits, self.tokenizer.encode_prompt(prompt))

    def render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise ApiError(400, f"model `{self.name}` has no chat template (its checkpoint's tokenizer config holds "
                                "none); send a prompt to /v1/completions instead", "messages", "no_chat_template")
        try:
            return self.tokenizer.render_chat(messages)
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None


def load_deployment(repository: Path, name: str) -> Deployment | None:
    """What the served generation's exported tokenizer says: pair size, chat template."""
    generation = served_generation(repository, name)
    if generation is None:
        return None
    folder = repository / f"{pipeline_name(name, generation)}_preprocessing" / "1" / "tokenizer"
    manifest = json.loads((folder / "manifest.json").read_text())
    config = folder / "tokenizer_config.json"
    tokenizer = None
    if config.exists() and json.loads(config.read_text()).get("chat_template"):
        tokenizer = TextTokenizer.from_json((folder / "tokenizer.json").read_text(), config.read_text())
    config = served_config(repository, name)
    return Deployment(name, manifest["settings"].get("pair_size", 1), tokenizer, config.limits() if config else None)


class Service:
    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.keys_file = KeysFile(settings.keys_file, lambda message: print(message, file=sys.stderr, flush=True)) \
            if settings.keys_file else None
        self.caps = KeyCaps()
        down_dir = settings.gateway_prefix / "down" if settings.gateway_prefix else None
        self.marks = DownMarks(down_dir)
        self.readiness = Readiness(self.model_ready, READY_TTL_S)
        self.deployments: dict[str, tuple[object, Deployment | None]] = {}
        self.registry = CollectorRegistry()
        labels = ("client", "model")
        self.prompt_tokens = Counter("dualend_api_prompt_tokens", "prompt tokens served, by API key name",
                                     labels, registry=self.registry)
        self.completion_tokens = Counter("dualend_api_completion_tokens", "completion tokens served, by API key name",
                                         labels, registry=self.registry)
        self.requests = Counter("dualend_api_requests", "requests answered, by API key name and status",
                                (*labels, "status"), registry=self.registry)
        self.usage = UsageStore(settings.usage_db) if settings.usage_db else None
        self.client = None
        self._canary = (None, settings.baseline_percent)

    # the pieces a request needs

    def deployment(self, name: str) -> Deployment:
        """The deployment's details, reread when its ensemble names another generation."""
        config = self.settings.model_repository / name / "config.pbtxt"
        stamp = config.stat().st_mtime_ns if config.exists() else None
        cached = self.deployments.get(name)
        if cached is None or cached[0] != stamp:
            cached = self.deployments[name] = (stamp, load_deployment(self.settings.model_repository, name))
        if cached[1] is None:
            raise ApiError(404, f"model `{name}` is not served here", "model", "model_not_found")
        return cached[1]

    async def served_models(self) -> list[str]:
        """The deployments whose ensemble the repository holds and tritonserver has ready (the public ones
        first), and the canary when both of its deployments are."""
        repository = self.settings.model_repository
        found = sorted(served_deployments(repository),
                       key=lambda name: (name not in PUBLIC_DEPLOYMENTS, PUBLIC_DEPLOYMENTS.index(name)
                                         if name in PUBLIC_DEPLOYMENTS else 0, name))
        ready = await asyncio.gather(*(self.readiness.is_ready(name) for name in found))
        served = [name for name, is_ready in zip(found, ready) if is_ready]
        return served + ([CANARY_MODEL] if set(CANARY_PAIR) <= set(served) else [])

    def baseline_percent(self) -> float:
        """The canary weight: the gateway's (`python -m dualend.ops.gateway weight` rewrites it), else ours."""
        path = self.settings.gateway_prefix / "settings.json" if self.settings.gateway_prefix else None
        if path is None or not path.exists():
            return self.settings.baseline_percent
        stamp = path.stat().st_mtime_ns
        if self._canary[0] != stamp:
            self._canary = (stamp, float(json.loads(path.read_text()).get("baseline_percent", 10.0)))
        return self._canary[1]

    async def resolve(self, model: str) -> str:
        """The deployment that serves `model`: itself, or for the canary one of its pair by the weight."""
        needed = CANARY_PAIR if model == CANARY_MODEL else (model,)
        if not all(re.fullmatch(r"\w+", name) and served_generation(self.settings.model_repository, name) is not None
                   for name in needed):
            raise ApiError(404, f"model `{model}` does not exist; GET /v1/models lists them", "model",
                           "model_not_found")
        for deployment in needed:
            await self.check_ready(deployment, model)
        if model == CANARY_MODEL:
            return "baseline" if random.uniform(0, 100) < self.baseline_percent() else "dualend"
        return model

    async def check_ready(self, deployment: str, model: str) -> None:
        """A deployment tritonserver has not ready: 503 "retry" while the watchdog restores it, else 404
        (unloaded, or loading: readiness tells them apart no more than that)."""
        if await self.readiness.is_ready(deployment):
            return
        self.marks.check_up(deployment)
        needs = "" if deployment == model else f" (it needs `{deployment}`)"
        raise ApiError(404, f"model `{model}` is not served now{needs}: the repository holds it but the server has not "
                            "loaded it (unloaded, or still loading); GET /v1/models lists the models served", "model",
                       "model_not_loaded")

    async def model_ready(self, deployment: str) -> bool:
        return await self.client.is_model_ready(deployment, client_timeout=READY_TIMEOUT_S)

    def authorize(self, request: Request) -> ApiKey:
        return self.authorize_header(request.headers.get("authorization"))

    def authorize_header(self, authorization: str | None) -> ApiKey:
        if self.keys_file is None:  # no keys, no one to be fair between: no cap
            return ApiKey("anonymous", "", sys.maxsize)
        client = client_of(authorization, self.keys_file.current())  # the file as it is now
        if client is None:
            raise ApiError(401, "missing or unknown API key: send Authorization: Bearer <key>", code="invalid_api_key")
        return client

    # the Triton side

    async def triton_stream(self, request: Generation, deployment: str, progress: Progress):
        """Yields (text, counters, triton finish reason) per response of one streamed request; the
        gRPC call is cancelled (the request and its KV freed) however the caller stops."""
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, array in triton_inputs(request).items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else
                                           {np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64",
                                            np.bool_: "BOOL"}[array.dtype.type])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)

        ended = asyncio.Event()

        async def one_request():
            yield {"model_name": deployment, "inputs": inputs,
                   "parameters": {"triton_enable_empty_final_response": True}}
            # Open until the request ends: with each stream half-closed at once tritonserver 2.51's RSS grew
            # ~23 KB a request at c32, kept open ~8 KB (reports/soak_v1.txt)
            await ended.wait()

        responses: asyncio.Queue = asyncio.Queue()
        call = self.client.stream_infer(one_request())

        async def read():
            try:
                async for item in call:
                    await responses.put(item)
            except grpc.RpcError as error:
                await responses.put((None, error))
            except Exception as error:  # noqa: BLE001 - tritonclient wraps some as its own exception
                await responses.put((None, error))

        reader = asyncio.create_task(read())
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(TICK_S):  # no task per response, unlike wait_for
                        result, error = await responses.get()
                except TimeoutError:
                    progress.check()
                    continue
                if error is not None:
                    finished = True
                    message = error.details() if isinstance(error, grpc.RpcError) else (
                        error.message() if hasattr(error, "message") else str(error))
                    if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
                        raise ApiError(503, f"the inference server is not answering ({message}); retry", code="retry")
                    raise triton_error(message or "the inference server failed the request", request)
                progress.advanced()
                text = result.as_numpy("text_output")
                if text is not None:
                    yield (text[0].decode(), {n: int(result.as_numpy(n)[0]) for n in COUNTERS},
                           result.as_numpy("finish_reason")[0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished = True
                    return
        finally:
            ended.set()
            if not finished:
                call.cancel()
            reader.cancel()

    # the routes

    def count(self, client: ApiKey, model: str, counters: dict, status: int) -> None:
        prompt, completion = counters.get("num_prompt_tokens", 0), counters.get("num_output_tokens", 0)
        self.prompt_tokens.labels(client.name, model).inc(prompt)
        self.completion_tokens.labels(client.name, model).inc(completion)
        self.requests.labels(client.name, model, str(status)).inc()
        if self.usage is not None:
            self.usage.record(client.name, prompt, counters.get("num_cached_tokens", 0), completion)

    def admit(self, client: ApiKey, deployment: str):
        """The key's place for one request of a deployment that is up, taken (the caller gives it back
        with `__exit__` however the request ends); every route's admission."""
        self.marks.check_up(deployment)
        admission = self.caps.admit(client)
        admission.__enter__()
        return admission

    def check_quota(self, client: ApiKey) -> None:
        """429 `quota_exceeded` once the key's tokens today (UTC) reached its daily_tokens."""
        if client.daily_tokens is None or self.usage is None:
            return
        used = self.usage.tokens(client.name)
        if used >= client.daily_tokens:
            raise ApiError.of(Outcome.QUOTA_EXCEEDED, f"API key {client.name!r} used {used} tokens today (UTC), its "
                                                     f"daily_tokens quota is {client.daily_tokens}; it renews at 00:00 UTC",
                              retry_after_s=seconds_to_next_day())

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
            served = await self.served_models()
        except ApiError as error:
            return error_response(error)
        return JSONResponse({"object": "list", "data": [model_object(name) for name in served]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve): a served model, else 404."""
        name = request.path_params["model"]
        try:
            self.authorize(request)
            if name not in await self.served_models():
                raise ApiError(404, f"the model `{name}` is not served here (GET /v1/models lists them)", "model",
                               "model_not_found")
        except ApiError as error:
            return error_response(error)
        return JSONResponse(model_object(name))

    async def generate(self, request: Request) -> Response:
        kind = "chat" if request.url.path.endswith("/chat/completions") else "completions"
        try:
            client = self.authorize(request)
            self.check_quota(client)
            body = await request.body()
            if len(body) > self.settings.max_body_bytes:
                raise ApiError(413, f"request body over {self.settings.max_body_bytes} bytes", code="too_large")
            parsed = parse_body(body)
            model = parsed.get("model")
            deployment = await self.resolve(model) if isinstance(model, str) else None
            if kind == "chat":
                generation = parse_chat(parsed, lambda messages: self.deployment(deployment).render_chat(messages),
                                        lambda prompt: self.deployment(deployment).room(prompt))
            else:
                generation = parse_completion(parsed)
            if self.keys_file is not None:  # one key's prefixes are its own, whatever salt it sends (names hold no /)
                generation.cache_salt, generation.client = keyed_salt(client.name, generation.cache_salt), client.name
            self.deployment(deployment)
            admission = self.admit(client, deployment)
        except ApiError as error:
            return error_response(error)
        headers = {"X-Dualend-Deployment": deployment}
        try:
            if generation.stream:
                return await self.stream(request, generation, deployment, client, admission, headers)
            return await self.complete(request, generation, deployment, client, headers)
        finally:
            if not generation.stream:
                admission.__exit__(None, None, None)

    async def complete(self, request: Request, generation: Generation, deployment: str, client: ApiKey,
                       headers: dict) -> Response:
        text, reason, counters = "", "", dict.fromkeys(COUNTERS, 0)
        progress = Progress(self.marks, deployment, self.settings.stall_s, self.settings.hang_s)
        gone = False

        async def watch_disconnect(scope):
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        failure = None
        async with anyio.create_task_group() as group:
            group.start_soon(watch_disconnect, group.cancel_scope)
            try:
                async for piece, piece_counters, piece_reason in self.triton_stream(generation, deployment, progress):
                    text += piece
                    merge_counters(counters, piece_counters)
                    reason = piece_reason or reason
            except ApiError as error:
                failure = error
            group.cancel_scope.cancel()
        if failure is not None:
            self.count(client, generation.model, counters, failure.status)
            return error_response(failure, headers)
        self.count(client, generation.model, counters, 499 if gone else 200)
        dual_end = self.deployment(deployment).dual_end
        return JSONResponse(response_body(generation, generation.model, text, finish_reason(reason),
                                          usage(counters, dual_end)), headers=headers)

    async def stream(self, request: Request, generation: Generation, deployment: str, client: ApiKey, admission,
                     headers: dict) -> Response:
        """SSE chunks; an error before the first token is an HTTP status, after it an error event."""
        counters = dict.fromkeys(COUNTERS, 0)
        progress = Progress(self.marks, deployment, self.settings.stall_s, self.settings.hang_s)
        pieces = self.triton_stream(generation, deployment, progress)
        try:
            first = await unless_gone(request.receive, anext(pieces, None))
        except ApiError as error:
            admission.__exit__(None, None, None)
            self.count(client, generation.model, counters, error.status)
            return error_response(error, headers)
        except ClientGone:  # left while waiting for its first token (queued): the request is cancelled
            admission.__exit__(None, None, None)
            self.count(client, generation.model, counters, 499)
            await pieces.aclose()
            return Response(status_code=499)
        except BaseException:
            admission.__exit__(None, None, None)
            raise
        dual_end = self.deployment(deployment).dual_end
        status = 499  # unless it ends
        closed = False

        async def close():
            """Frees the key's place, counts the tokens and cancels the Triton request, once; also when
            the client left before the first chunk was sent (the generator never started)."""
            nonlocal closed
            if not closed:
                closed = True
                admission.__exit__(None, None, None)
                self.count(client, generation.model, counters, status)
                await pieces.aclose()

        async def events():
            nonlocal status
            try:
                piece = first
                is_first = True
                while piece is not None:
                    text, piece_counters, reason = piece
                    merge_counters(counters, piece_counters)
                    if text or reason or is_first:
                        yield sse(chunk_body(generation, generation.model, text, finish_reason(reason), is_first))
                        is_first = False
                    piece = await anext(pieces, None)
                if generation.include_usage:
                    yield sse(usage_chunk(generation, generation.model, usage(counters, dual_end)))
                status = 200
                yield b"data: [DONE]\n\n"
            except ApiError as error:
                status = error.status
                yield sse(error.body())
                yield b"data: [DONE]\n\n"
            finally:
                await close()

        return DisconnectAwareStream(events(), close, media_type="text/event-stream",
                                     headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            import tritonclient.grpc.aio as grpcaio

            self.client = grpcaio.InferenceServerClient(self.settings.triton_grpc, channel_args=TO_LOCAL_SERVER)
            poller = asyncio.create_task(self.marks.run())
            await http_generate.start()
            grpc_server = None
            if self.settings.grpc_port is not None:
                grpc_front = GrpcFront(self, self.settings.triton_grpc)
                grpc_server = grpc.aio.server(options=UNLIMITED_MESSAGES)
                grpc_server.add_generic_rpc_handlers((grpc_front.handler(),))
                grpc_server.add_insecure_port(f"{self.settings.host}:{self.settings.grpc_port}")
                await grpc_server.start()
            try:
                yield
            finally:
                if grpc_server is not None:
                    await grpc_server.stop(grace=1.0)
                    await grpc_front.close()
                poller.cancel()
                await http_generate.close()
                await self.client.close()

        http_generate = HttpGenerate(self, self.settings.triton_http)

        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.generate, methods=["POST"]),
                  Route("/v1/chat/completions", self.generate, methods=["POST"]),
                  Route("/v2/models/{model}/generate", http_generate.generate, methods=["POST"]),
                  Route("/v2/models/{model}/generate_stream", http_generate.generate, methods=["POST"]),
                  Route("/metrics", self.metrics, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={404: not_found, 405: not_allowed, Exception: internal_error})


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_response(error: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=(headers or {}) | error.headers())


async def not_found(request: Request, exc) -> Response:
    return error_response(ApiError(404, f"{request.url.path} is not a route of this service", code="not_found"))


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "dualend"}


async def internal_error(request: Request, exc) -> Response:
    """A fault of this service's own, in OpenAI's shape (Starlette logs it and its traceback)."""
    return error_response(ApiError(500, f"internal error of the OpenAI service ({type(exc).__name__}); "
                                        "the request was not run", code="internal_error"))


async def not_allowed(request: Request, exc) -> Response:
    return error_response(ApiError(405, f"{request.method} is not served on {request.url.path}",
                                   code="method_not_allowed"))
