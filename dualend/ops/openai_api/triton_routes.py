"""Triton's own routes, fronted by this service as /v1 is: the gateway passes Triton's gRPC
InferenceService (`GrpcFront`, a proxy that reads each request of a stream and each response) and the
HTTP generate / generate_stream routes (`HttpGenerate`, relayed to tritonserver's HTTP endpoint) here.

So every route gets what /v1 gets: one cap per API key counted per request (not per stream or
connection) across every route, the daily quota, tokens recorded in the usage database, and an end,
with a retryable `[step_failed]` error, to a request whose deployment failed or stopped under it
(tritonserver 2.51 never ends the requests of a dead Python stub). The front's own refusals lead their
message with their outcome's code (`[too_many_requests_for_key] ...`), as the decode loop's do.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

import aiohttp
import grpc
from google.protobuf.message import DecodeError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from tritonclient.grpc import service_pb2

from dualend.serving.contract import COUNTERS, merge_counters
from dualend.serving.repository import CANARY_MODEL

from ..api_keys import ApiKey, keyed_salt
from ..host import TO_LOCAL_SERVER
from .front import ClientGone, DisconnectAwareStream, Progress, unless_gone
from .translation import ApiError, triton_error

GRPC_SERVICE = "inference.GRPCInferenceService"
UNARY_METHODS = ("ModelInfer", "ModelMetadata", "ModelReady", "ServerLive", "ServerReady", "ServerMetadata")
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
TICK_S = 0.1  # how often the requests in flight are checked against their deployment's marks


def forwarded_metadata(context) -> tuple:
    """The caller's metadata for tritonserver, without its API key and gRPC's own headers."""
    return tuple((key, value) for key, value in context.invocation_metadata()
                 if key not in ("authorization", "user-agent") and not key.startswith((":", "grpc-")))


def counters_of(response: service_pb2.ModelInferResponse) -> dict[str, int]:
    """The contract's counter outputs (INT32 [1]) of one response, from its raw output contents."""
    found = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.name in COUNTERS and len(raw) >= 4:
            found[output.name] = int.from_bytes(raw[:4], "little", signed=True)
    return found


def upstream_body(body: bytes, whole: bool, key_name: str | None) -> bytes:
    """A generate body as the front sends it on: with `stream` true when the client wants one answer
    (`whole`: the front joins it), and, where keys are in use, the key's name as its `client` and at the
    head of its `cache_salt`, as /v1 sends them. A body that is not a JSON object is a 400."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not JSON (UTF-8), or nests too deep") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the request body must be a JSON object of inputs")
    if key_name is not None:
        salt = parsed.get("cache_salt", "")
        if isinstance(salt, list) and len(salt) == 1:
            salt = salt[0]
        if not isinstance(salt, str):
            raise ApiError(400, "cache_salt must be a string", "cache_salt")
        parsed["cache_salt"], parsed["client"] = keyed_salt(key_name, salt), key_name
    if whole:
        parsed["stream"] = True
    return json.dumps(parsed).encode()


def key_request(request: service_pb2.ModelInferRequest, name: str) -> None:
    """The gRPC request, in place, with the API key's name as its `client` and leading its `cache_salt`
    (BYTES inputs, in the request's own layout: raw contents or typed ones)."""
    prefix = keyed_salt(name).encode()
    _set_first_bytes(request, "cache_salt", lambda old: prefix + (old or b""))
    _set_first_bytes(request, "client", lambda old: name.encode())


def _set_first_bytes(request: service_pb2.ModelInferRequest, input_name: str, value_of) -> None:
    raw = len(request.raw_input_contents) > 0
    index = next((i for i, tensor in enumerate(request.inputs) if tensor.name == input_name), None)
    if index is None:
        tensor = request.inputs.add(name=input_name, datatype="BYTES", shape=[1])
        index = len(request.inputs) - 1
        if raw:
            request.raw_input_contents.append(b"")
    tensor = request.inputs[index]
    if raw:
        contents = request.raw_input_contents[index]
        size = int.from_bytes(contents[:4], "little") if len(contents) >= 4 else 0
        first, rest = (contents[4:4 + size], contents[4 + size:]) if len(contents) >= 4 else (None, b"")
        value = value_of(first)
        request.raw_input_contents[index] = len(value).to_bytes(4, "little") + value + rest
    else:
        elements = tensor.contents.bytes_contents
        value = value_of(elements[0] if elements else None)
        if elements:
            elements[0] = value
        else:
            elements.append(value)


def decoded_request(raw: bytes, request: service_pb2.ModelInferRequest) -> None:
    """`raw` read into `request` (in place, so that what did decode can be named in an error); ApiError
    400 when it does not decode, or holds raw contents that are not one per input (the layouts mixed)."""
    try:
        request.ParseFromString(raw)
    except DecodeError:
        raise ApiError(400, "the stream's request is not a ModelInferRequest (it does not decode)") from None
    raw_count, inputs = len(request.raw_input_contents), len(request.inputs)
    if raw_count and raw_count != inputs:
        raise ApiError(400, f"raw_input_contents holds {raw_count} entries for {inputs} inputs: give every input "
                            "its raw contents, or none (typed contents)")


def streamed(request: service_pb2.ModelInferRequest) -> bool:
    """Whether the request asks for a stream of responses (its `stream` input; false when absent)."""
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "stream":
            if request.raw_input_contents:
                return request.raw_input_contents[index][:1] not in (b"", b"\x00")
            return bool(tensor.contents.bool_contents) and tensor.contents.bool_contents[0]
    return False


def stream_it(request: service_pb2.ModelInferRequest) -> None:
    """The request, in place, with its `stream` input true (in its own layout)."""
    raw = len(request.raw_input_contents) > 0
    index = next((i for i, tensor in enumerate(request.inputs) if tensor.name == "stream"), None)
    if index is None:
        request.inputs.add(name="stream", datatype="BOOL", shape=[1])
        if raw:
            request.raw_input_contents.append(b"\x01")
        else:
            request.inputs[-1].contents.bool_contents.append(True)
    elif raw:
        request.raw_input_contents[index] = b"\x01"
    else:
        request.inputs[index].contents.bool_contents[:] = [True]


def joined(request: "InFlight", final: bool) -> service_pb2.ModelStreamInferResponse:
    """The one response a request that asked for one gets: its streamed responses' texts joined and its
    counters merged, in the last one's layout."""
    whole = service_pb2.ModelStreamInferResponse()
    whole.infer_response.CopyFrom(request.gathered[-1])
    whole.infer_response.id = request.client_id
    whole.infer_response.parameters[FINAL].bool_param = final
    text = b"".join(_first_bytes(r, "text_output") for r in request.gathered)
    for index, output in enumerate(whole.infer_response.outputs):
        if output.name == "text_output":
            whole.infer_response.raw_output_contents[index] = len(text).to_bytes(4, "little") + text
        elif output.name in COUNTERS:
            whole.infer_response.raw_output_contents[index] = int(request.counters[output.name]).to_bytes(
                4, "little", signed=True)
    return whole


def empty_final(request: "InFlight") -> service_pb2.ModelStreamInferResponse:
    final = service_pb2.ModelStreamInferResponse()
    final.infer_response.id, final.infer_response.model_name = request.client_id, request.model
    final.infer_response.model_version = request.version
    final.infer_response.parameters[FINAL].bool_param = True
    return final


def _first_bytes(response: service_pb2.ModelInferResponse, name: str) -> bytes:
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.name == name and len(raw) >= 4:
            return raw[4:4 + int.from_bytes(raw[:4], "little")]
    return b""


def error_response(request_id: str, model: str, version: str, error: ApiError) -> bytes:
    """A stream's answer that ends one request with the front's error (the final one of that request)."""
    response = service_pb2.ModelStreamInferResponse(error_message=error.triton_message())
    response.infer_response.id, response.infer_response.model_name = request_id, model
    response.infer_response.model_version = version
    response.infer_response.parameters[FINAL].bool_param = True
    return response.SerializeToString()


@dataclass
class InFlight:
    """One request of a gRPC stream: its id as the client sent it, its key's place, its progress."""
    client_id: str
    model: str
    version: str
    wants_empty_final: bool
    admission: object
    progress: Progress
    counters: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    status: int = 200
    gathered: list | None = None  # a request that asked for one response: its streamed ones, joined at its end


class GrpcFront:
    """`inference.GRPCInferenceService` in front of tritonserver's: the unary methods passed as they are,
    ModelStreamInfer read request by request (each under the key's cap, ended by the front if its
    deployment fails or stops under it)."""

    def __init__(self, service, triton_grpc: str):
        self.service = service
        self.channel = grpc.aio.insecure_channel(triton_grpc, options=TO_LOCAL_SERVER)
        self.ids = itertools.count()

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {name: grpc.unary_unary_rpc_method_handler(self.passed(name)) for name in UNARY_METHODS}
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.stream_infer)
        return grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers)

    def passed(self, method: str):
        call = self.channel.unary_unary(f"/{GRPC_SERVICE}/{method}")

        async def handle(request: bytes, context):
            try:
                return await call(request, metadata=forwarded_metadata(context))
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details())
        return handle

    async def stream_infer(self, requests, context):
        authorization = dict(context.invocation_metadata()).get("authorization")
        try:
            client = self.service.authorize_header(authorization)
        except ApiError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error.message)
        upstream = self.channel.stream_stream(f"/{GRPC_SERVICE}/ModelStreamInfer")(
            metadata=forwarded_metadata(context))
        await FrontedStream(self, client, authorization, context, upstream).run(requests)

    async def close(self) -> None:
        await self.channel.close()


class FrontedStream:
    """One client's ModelStreamInfer stream and the one it opens to tritonserver. Each request is given
    an id of the front's own upstream (clients may send none, or the same twice) and asks for the empty
    final response, so the front knows when every request ends; the client gets its own ids back, and
    the empty final response only if it asked for it."""

    def __init__(self, front: GrpcFront, client: ApiKey, authorization: str | None, context, upstream):
        self.front, self.service, self.client, self.context, self.upstream = front, front.service, client, context, upstream
        self.authorization = authorization  # checked again at each request: a key revoked mid-stream ends there
        self.in_flight: dict[str, InFlight] = {}
        self.out: asyncio.Queue = asyncio.Queue()  # serialized responses for the client; None: the stream ends
        self.client_done = False

    async def run(self, requests) -> None:
        tasks = [asyncio.create_task(job) for job in (self.send(requests), self.receive(), self.watch())]
        try:
            while (response := await self.out.get()) is not None:
                await self.context.write(response)
        finally:
            for task in tasks:
                task.cancel()
            self.upstream.cancel()
            for request_id in list(self.in_flight):
                self.end(request_id, 499)

    async def send(self, requests) -> None:
        try:
            async for raw in requests:
                request = service_pb2.ModelInferRequest()
                try:
                    decoded_request(raw, request)
                    self.client = self.service.authorize_header(self.authorization)
                    if request.model_name == CANARY_MODEL:  # split as the gateway splits HTTP requests
                        request.model_name = await self.service.resolve(CANARY_MODEL)
                    request_id = self.admit(request)
                except ApiError as error:
                    self.out.put_nowait(error_response(request.id, request.model_name, request.model_version, error))
                    continue
                request.id = request_id
                request.parameters[EMPTY_FINAL].bool_param = True
                if not streamed(request):  # asked of tritonserver as a stream, so its progress shows
                    self.in_flight[request_id].gathered = []
                    stream_it(request)
                if self.service.keys_file is not None:
                    key_request(request, self.client.name)
                await self.upstream.write(request.SerializeToString())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # tritonserver closed its stream: receive() ends what is in flight
        self.client_done = True
        self.end_if_done()

    def admit(self, request: service_pb2.ModelInferRequest) -> str:
        """The request's upstream id, once its key may run one more and its deployment is not down."""
        self.service.check_quota(self.client)
        admission = self.service.admit(self.client, request.model_name)
        wants = EMPTY_FINAL in request.parameters and request.parameters[EMPTY_FINAL].bool_param
        request_id = f"front-{next(self.front.ids)}"
        settings = self.service.settings
        self.in_flight[request_id] = InFlight(request.id, request.model_name, request.model_version, wants, admission,
                                              Progress(self.service.marks, request.model_name, settings.stall_s,
                                                       settings.hang_s))  # every request streams upstream
        return request_id

    async def receive(self) -> None:
        ended_by = "tritonserver ended the stream"
        try:
            async for raw in self.upstream:
                response = service_pb2.ModelStreamInferResponse.FromString(raw)
                request_id = response.infer_response.id
                request = self.in_flight.get(request_id)
                if request is None:
                    continue  # ended by the front already
                request.progress.advanced()
                merge_counters(request.counters, counters_of(response.infer_response))
                parameters = response.infer_response.parameters
                final = FINAL in parameters and parameters[FINAL].bool_param
                if response.error_message:
                    request.status = triton_error(response.error_message).status
                    request.gathered = None  # the error is the answer
                if request.gathered is not None:
                    if response.infer_response.outputs:
                        request.gathered.append(response.infer_response)
                    if final and not request.gathered:  # ended with no answer at all: say so, or it waits forever
                        request.status = 503
                        self.out.put_nowait(error_response(request.client_id, request.model, request.version, ApiError(
                            503, "tritonserver ended the request without a response; retry", code="retry")))
                    elif final:
                        self.out.put_nowait(joined(request, not request.wants_empty_final).SerializeToString())
                        if request.wants_empty_final:
                            self.out.put_nowait(empty_final(request).SerializeToString())
                    if final:
                        self.end(request_id, request.status)
                    continue
                response.infer_response.id = request.client_id
                empty = not response.infer_response.outputs and not response.error_message
                if not (final and empty and not request.wants_empty_final):
                    self.out.put_nowait(response.SerializeToString())
                if final:
                    self.end(request_id, request.status)
        except grpc.aio.AioRpcError as error:
            ended_by = f"tritonserver ended the stream ({error.code().name}: {error.details()})"
        except asyncio.CancelledError:
            return
        for request_id, request in list(self.in_flight.items()):
            self.out.put_nowait(error_response(request.client_id, request.model, request.version,
                                               ApiError(503, f"{ended_by}; retry", code="retry")))
            self.end(request_id, 503)
        self.out.put_nowait(None)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for request_id, request in list(self.in_flight.items()):
                try:
                    request.progress.check()
                except ApiError as error:
                    self.out.put_nowait(error_response(request.client_id, request.model, request.version, error))
                    self.end(request_id, error.status)

    def end(self, request_id: str, status: int) -> None:
        request = self.in_flight.pop(request_id)
        request.admission.__exit__(None, None, None)
        self.service.count(self.client, request.model, request.counters, status)
        self.end_if_done()

    def end_if_done(self) -> None:
        if self.client_done and not self.in_flight:
            self.out.put_nowait(None)


class HttpGenerate:
    """POST /v2/models/{model}/generate and generate_stream, checked by the gateway, relayed to
    tritonserver's HTTP endpoint and answered as it answers; the front adds the key's cap, quota and
    usage, and ends a request whose deployment failed, stopped or hung under it (503, or a last event
    `{"error": "[step_failed] ..."}` on a stream that already answered). A `generate` request is asked of
    generate_stream and its answer put together here, so that its progress shows; a generate_stream
    answer starts once its first event is in. An error before any token (either route) has the status of
    its outcome code (tritonserver answers 400 to every one)."""

    def __init__(self, service, triton_http: str):
        self.service, self.triton_http = service, triton_http
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: Request) -> Response:
        deployment, route = request.path_params["model"], request.url.path.rpartition("/")[2]
        try:
            client = self.service.authorize(request)
            whole = route == "generate"  # asked of generate_stream and joined here, so its progress shows
            keyed = client.name if self.service.keys_file is not None else None
            body = upstream_body(await request.body(), whole, keyed)
            self.service.check_quota(client)
            admission = self.service.admit(client, deployment)
        except ApiError as error:
            return triton_error_response(error)
        counters, status = dict.fromkeys(COUNTERS, 0), 499
        settings = self.service.settings
        progress = Progress(self.service.marks, deployment, settings.stall_s, settings.hang_s)
        upstream, closed = None, False

        async def close() -> None:
            """Frees the key's place, counts the tokens and lets go of the upstream answer, once."""
            nonlocal closed
            if not closed:
                closed = True
                admission.__exit__(None, None, None)
                self.service.count(client, deployment, counters, status)
                if upstream is not None:
                    upstream.release() if status == upstream.status else upstream.close()

        async def post() -> None:  # tritonserver answers with its first event (a queued request: later)
            nonlocal upstream
            upstream = await self.watched(self.session.post(
                f"http://{self.triton_http}/v2/models/{deployment}/generate_stream", data=body,
                headers={"Content-Type": "application/json"}), progress)

        try:
            await unless_gone(request.receive, post())
            if whole:
                status, answer, headers = await unless_gone(request.receive,
                                                            self.gathered(upstream, progress, counters))
                await close()
                return JSONResponse(answer, status_code=status, headers=headers)
            upstream_events = self.events_of(upstream, progress)
            first = await unless_gone(request.receive, anext(upstream_events, b""))
            merge_counters(counters, counters_in(first))
            parsed = event_json(first)
            if "error" in parsed:  # refused before any token: a status by its outcome, not a 200 stream
                status, answer, headers = refusal(str(parsed["error"]), upstream.status)
                await upstream_events.aclose()
                await close()
                return JSONResponse(answer, status_code=status, headers=headers)
        except ApiError as error:
            status = error.status
            await close()
            return triton_error_response(error)
        except aiohttp.ClientError as error:
            status = 503
            await close()
            return triton_error_response(ApiError(503, f"the inference server is not answering ({error}); retry",
                                                  code="retry"))
        except ClientGone:  # left before its answer started: the upstream request is dropped with it
            status = 499
            await close()
            return Response(status_code=499)
        except BaseException:  # cancelled (the service stopping): the key's place is given back all the same
            await close()
            raise

        async def events():
            nonlocal status
            try:
                if first:
                    yield first
                async for event in upstream_events:
                    merge_counters(counters, counters_in(event))
                    yield event
                status = upstream.status
            except ApiError as error:
                status = error.status
                yield b"data: " + json.dumps({"error": error.triton_message()}).encode() + b"\n\n"
            except aiohttp.ClientError as error:  # tritonserver went away mid-stream
                status = 503
                yield b"data: " + json.dumps({"error": f"the inference server ended the stream ({error}); "
                                                        "retry"}).encode() + b"\n\n"
            finally:
                await close()

        return DisconnectAwareStream(events(), close, status_code=upstream.status,
                                     media_type=upstream.headers.get("Content-Type", "text/event-stream"),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def events_of(self, upstream: aiohttp.ClientResponse, progress: Progress):
        """The upstream's SSE events (`data: ...` blocks) one by one, as they come."""
        pending = b""
        while True:
            chunk = await self.watched(upstream.content.readany(), progress)
            if not chunk:
                if pending:
                    yield pending
                return
            progress.advanced()
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                yield event + b"\n\n"

    async def gathered(self, upstream: aiohttp.ClientResponse, progress: Progress,
                       counters: dict) -> tuple[int, dict, dict]:
        """(status, answer, headers) of a `generate` request asked of generate_stream, so the front sees
        it progress: the answer tritonserver's `generate` gives (the texts joined, the counters merged,
        the last response's other fields), or the error's, its status by its outcome code."""
        answer, texts = {}, []
        async for event in self.events_of(upstream, progress):
            parsed = event_json(event)
            if not parsed:
                continue
            if "error" in parsed:
                return refusal(str(parsed["error"]), upstream.status)
            merge_counters(counters, counters_in(event))
            texts.append(str(parsed.get("text_output", "")))
            answer = parsed
        if not answer:
            raise ApiError(503, "the inference server ended the answer before any response; retry", code="retry")
        return 200, answer | {"text_output": "".join(texts)} | {name: counters[name] for name in COUNTERS}, {}

    @staticmethod
    async def watched(awaitable, progress: Progress):
        """The awaitable's result, or ApiError once the request's deployment failed under it."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=TICK_S)
                if done:
                    return task.result()
                progress.check()
        finally:
            task.cancel()


def refusal(message: str, upstream_status: int) -> tuple[int, dict, dict]:
    """(status, answer, headers) of an error tritonserver answered before any token: by its outcome
    code (429 and Retry-After for a busy deployment, ...); tritonserver's own errors, which carry none,
    as it answers them."""
    error = triton_error(message)
    if error.outcome is None:
        return (upstream_status if upstream_status != 200 else 400), {"error": message}, {}
    return error.status, {"error": error.triton_message()}, error.headers()


def event_json(payload: bytes) -> dict:
    """One generate answer or SSE event (`data: {...}`) of tritonserver's as a JSON object ({} if not one)."""
    text = payload.decode(errors="replace").strip()
    text = text[len("data:"):].strip() if text.startswith("data:") else text
    try:
        answer = json.loads(text)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def counters_in(payload: bytes) -> dict[str, int]:
    """The counters of one generate answer or SSE event of tritonserver's."""
    answer = event_json(payload)
    return {name: int(answer[name]) for name in COUNTERS if isinstance(answer.get(name), int)}



def triton_error_response(error: ApiError) -> JSONResponse:
    """A refusal as tritonserver's HTTP routes answer one: {"error": "<message>"}."""
    return JSONResponse({"error": error.triton_message()}, status_code=error.status, headers=error.headers())
