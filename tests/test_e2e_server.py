"""End to end against a real tritonserver serving the shipped checkpoints (both deployments).

The server is started once for the module from a repository assembled into a temporary folder;
the in-process ONNX Runtime engine on the same export is the reference for every text.
"""
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import until_launcher_serves, wait_for

from builder.assemble import DEFAULTS
from builder.assemble import main as assemble_main
from client.api import RequestError, generate_http, metric_value, stream_grpc, stream_http
from dualend.engine.decode import SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.ops.host import free_ports
from dualend.ops.launch import TritonServer
from dualend.serving.control import drain_request
from dualend.serving.offline import generate_text
from dualend.serving.outcomes import Outcome
from dualend.train.data import FAMILIES, eval_set, sized_examples

pytestmark = pytest.mark.server
CHECKPOINTS = Path(os.environ.get("DUALEND_CHECKPOINTS", DEFAULTS["checkpoints"]))
PROMPTS = [eval_set(f, 2, seed=5)[i].prompt for f in FAMILIES for i in range(2)]
DEPLOYMENTS = ("dualend", "baseline")


def assemble_dualend(folder, *flags, checkpoints=CHECKPOINTS):
    """The dual-end deployment assembled into folder/repository: the first call writes generation 1,
    each later one the next generation beside it."""
    return assemble_main(["--checkpoints", str(checkpoints), "--out", str(folder / "repository"),
                          "--export-dir", str(folder / "export"), "--deployments", "dualend", *flags])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    repository = assemble_main(["--checkpoints", str(CHECKPOINTS), "--out", str(root / "repository"),
                                "--export-dir", str(root / "export"), "--deployments", *DEPLOYMENTS,
                                "--max-concurrent-requests", "16",
                                "--raw-context-limit", "512", "--max-new-tokens", "256",
                                "--prefill-chunk-tokens", "64"])
    with TritonServer(repository, log_file=root / "server.log") as triton:
        triton.export_dir = root / "export"
        triton.repository = repository
        yield triton


@pytest.fixture(scope="module")
def engines(server):
    return {name: OnnxComponents(server.export_dir / name) for name in DEPLOYMENTS}


def served_threshold(server, deployment):
    config = (server.repository / f"{deployment}_v1_mtp_verify" / "config.pbtxt").read_text()
    return float(re.search(r'key: "acceptance_threshold" value: \{ string_value: "([^"]+)"', config).group(1))


def engine_text(server, engines, deployment, prompt, max_tokens, **params):
    components = engines[deployment]
    tokenizer = components.exported.tokenizer()
    return generate_text(components, tokenizer, prompt, SamplingParams(max_tokens=max_tokens, **params),
                         served_threshold(server, deployment))


def metric(server, name, model):
    return metric_value(server.metrics_url, name, model)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.parametrize("transport", ["grpc", "sse", "generate"])
def test_served_text_equals_the_in_process_engine(server, engines, deployment, transport):
    for prompt in PROMPTS:
        expected = engine_text(server, engines, deployment, prompt, 40)
        if transport == "grpc":
            result = stream_grpc(server.grpc_url, deployment, prompt, 40, exclude_input_in_output=True)
        elif transport == "sse":
            result = stream_http(server.http_url, deployment, prompt, 40, exclude_input_in_output=True)
        else:
            result = generate_http(server.http_url, deployment, prompt, 40, exclude_input_in_output=True)
        assert result.text == expected.text
        assert result.output_tokens == len(expected.tokens)
        assert result.counters["num_steps"] == expected.steps
        assert result.counters["num_accepted_drafts"] == expected.accepted


def test_dualend_streams_pairs_and_counts_prompt_latents(server):
    result = stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 40, exclude_input_in_output=True,
                         acceptance_threshold=-1.0)  # always accept: every step but the last emits a pair
    assert result.counters["num_prompt_latents"] == (result.counters["num_prompt_tokens"] + 1) // 2
    assert result.counters["num_drafts"] > 0, "a dual-end deployment must draft (never silently token-level)"
    assert len(result.arrivals) == result.counters["num_steps"]  # one streamed response per decode step
    assert result.output_tokens <= 2 * result.counters["num_steps"]
    assert result.counters["num_accepted_drafts"] == result.counters["num_drafts"]
    assert result.output_tokens >= 2 * (result.counters["num_steps"] - 1)
    baseline = stream_grpc(server.grpc_url, "baseline", PROMPTS[0], 40, exclude_input_in_output=True)
    assert baseline.counters["num_prompt_latents"] == baseline.counters["num_prompt_tokens"]


def test_prompt_is_echoed_unless_excluded(server):
    with_prompt = generate_http(server.http_url, "dualend", PROMPTS[0], 8)
    without = generate_http(server.http_url, "dualend", PROMPTS[0], 8, exclude_input_in_output=True)
    assert with_prompt.text == PROMPTS[0] + without.text


def test_stop_words_cut_the_text_like_the_engine(server, engines):
    prompt = eval_set("math", 1, seed=9)[0].prompt
    full = engine_text(server, engines, "dualend", prompt, 40, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    expected = engine_text(server, engines, "dualend", prompt, 40, ignore_eos=True, stop_words=(stop,))
    result = stream_grpc(server.grpc_url, "dualend", prompt, 40, exclude_input_in_output=True, ignore_eos=True,
                         stop_words=[stop])
    assert result.finish_reason == "stop" == expected.finish_reason
    assert result.text == expected.text and stop not in result.text and full.startswith(result.text)


def test_eight_concurrent_streams_all_finish_and_free_their_kv(server, engines):
    jobs = [(deployment, PROMPTS[i % len(PROMPTS)], 8 + 7 * i) for i in range(8)
            for deployment in ["dualend" if i % 2 == 0 else "baseline"]]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: stream_grpc(server.grpc_url, job[0], job[1], job[2],
                                                        exclude_input_in_output=True), jobs))
    for (deployment, prompt, max_tokens), result in zip(jobs, results):
        assert result.text == engine_text(server, engines, deployment, prompt, max_tokens).text
    for deployment in DEPLOYMENTS:
        assert wait_for(lambda: metric(server, "dualend_kv_live_sequences", f"{deployment}_v1_backbone") == 0)
        assert metric(server, "dualend_kv_blocks_used", f"{deployment}_v1_backbone") == 0


def test_thirty_two_streams_against_a_limit_of_sixteen_all_complete(server, engines):
    """Beyond max_concurrent_requests requests wait in the queue; none is refused."""
    jobs = [(DEPLOYMENTS[i % 2], PROMPTS[i % len(PROMPTS)], 12) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: stream_grpc(server.grpc_url, job[0], job[1], job[2],
                                                        exclude_input_in_output=True), jobs))
    for (deployment, prompt, max_tokens), result in zip(jobs, results):
        assert result.text == engine_text(server, engines, deployment, prompt, max_tokens).text


def test_non_utf8_text_gets_a_clear_error_and_the_server_stays_up(server):
    """Raw bytes over gRPC (JSON cannot carry them; the other malformed cases are below)."""
    with pytest.raises(RequestError, match="not valid UTF-8"):
        stream_grpc(server.grpc_url, "dualend", b"Q: \xff\xfe\nA:", 8)
    assert server.is_ready()
    assert stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 4).output_tokens > 0


def test_wrong_dtype_is_refused_by_name(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Q: 1+1\nA:"], dtype=object))
    max_tokens = grpcclient.InferInput("max_tokens", [1], "FP32")
    max_tokens.set_data_from_numpy(np.array([8.0], dtype=np.float32))
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("dualend", [text, max_tokens])
    assert wait_for(lambda: errors, 10)
    client.stop_stream()
    assert "max_tokens" in str(errors[0]) and "FP32" in str(errors[0]) and "INT32" in str(errors[0])
    assert server.is_ready()


def test_sse_error_is_reported(server):
    with pytest.raises(RequestError, match="text_input is empty"):
        stream_http(server.http_url, "baseline", "", 8)


@pytest.mark.parametrize("transport", ["grpc", "generate"])
def test_a_follow_up_turn_reuses_the_kept_history_and_answers_as_the_engine_does(server, engines, transport):
    """The second turn re-sends the first turn's prompt and answer: the baseline's prefix cache holds
    them (it counts at least the first prompt but its last token, which may merge with the answer's
    first characters), and the answer is the in-process engine's, which has no prefix cache."""
    call = stream_grpc if transport == "grpc" else generate_http
    url = server.grpc_url if transport == "grpc" else server.http_url
    hits_before = metric(server, "dualend_prefix_cache_hits", "baseline_v1_mtp_verify") or 0
    first = call(url, "baseline", PROMPTS[2], 24, exclude_input_in_output=True)
    follow = PROMPTS[2] + first.text + "\n" + PROMPTS[3]
    second = call(url, "baseline", follow, 24, exclude_input_in_output=True)
    assert second.text == engine_text(server, engines, "baseline", follow, 24).text
    cached = second.counters["num_cached_tokens"]
    assert first.counters["num_prompt_tokens"] - 1 <= cached < second.counters["num_prompt_tokens"]
    assert first.counters["num_cached_tokens"] < first.counters["num_prompt_tokens"]
    assert wait_for(lambda: metric(server, "dualend_prefix_cache_hits", "baseline_v1_mtp_verify")
                    >= hits_before + cached)


def test_cancelled_stream_stops_generating_and_frees_its_kv(server):
    steps_before = metric(server, "dualend_decode_steps", "dualend_v1_mtp_verify") or 0
    cancelled_before = metric(server, "dualend_requests_cancelled", "dualend_v1_mtp_verify") or 0
    result = stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 250, ignore_eos=True,
                         exclude_input_in_output=True, cancel_after_responses=3)
    assert result.finish_reason == "cancelled"
    assert wait_for(lambda: metric(server, "dualend_requests_cancelled", "dualend_v1_mtp_verify") == cancelled_before + 1)
    assert wait_for(lambda: metric(server, "dualend_kv_live_sequences", "dualend_v1_backbone") == 0)
    steps = metric(server, "dualend_decode_steps", "dualend_v1_mtp_verify")
    time.sleep(1.0)
    assert metric(server, "dualend_decode_steps", "dualend_v1_mtp_verify") == steps, "generation went on"
    assert steps - steps_before < 250, "the whole generation ran despite the cancellation"


def test_a_backbone_from_another_checkpoint_is_refused_and_the_rest_keeps_serving(server, tmp_path):
    import shutil

    repository = tmp_path / "repository"
    shutil.copytree(server.repository, repository)
    backbone = repository / "dualend_v1_backbone" / "1" / "backbone"
    shutil.rmtree(backbone)
    shutil.copytree(server.repository / "baseline_v1_backbone" / "1" / "backbone", backbone)
    models = ["dualend_v1_backbone", "dualend", "baseline_v1_backbone", "baseline"]
    mixed = TritonServer(repository, model_control_mode="explicit", load_models=models,
                         extra_args=["--exit-on-error=false", "--strict-readiness=false"],
                         log_file=tmp_path / "server.log")
    with mixed:
        with pytest.raises(RequestError, match="not ready|unavailable|not found|failed"):
            stream_grpc(mixed.grpc_url, "dualend", PROMPTS[0], 4)
        assert stream_grpc(mixed.grpc_url, "baseline", PROMPTS[0], 4).output_tokens > 0
    log = (tmp_path / "server.log").read_text()
    assert re.search(r"dualend_v1_mtp_verify.*checkpoint mismatch", log)


def test_busy_server_refuses_clearly_and_the_running_stream_loses_nothing(tmp_path):
    """A KV budget of two rows as wide as a 2000-token sequence (32 MiB: 64 blocks of 64 pair slots of
    8 KB), one place in the queue: a 4000-token request would need two rows twice that wide, so it
    waits, then is refused saying why; one more while it waits finds the queue full; a small request
    fits beside the long one once the queue is clear, and the long one runs to the end."""
    repository = assemble_dualend(tmp_path, "--raw-context-limit", "4096", "--max-new-tokens", "4096",
                                  "--kv-cache-mb", "32", "--max-concurrent-requests", "2",
                                  "--max-queue-size", "1", "--queue-wait-s", "2")
    with TritonServer(repository, log_file=tmp_path / "server.log") as busy, ThreadPoolExecutor(2) as pool:
        long_stream = pool.submit(stream_grpc, busy.grpc_url, "dualend", PROMPTS[0], 2000, ignore_eos=True,
                                  acceptance_threshold=1.0, exclude_input_in_output=True)
        assert wait_for(lambda: metric(busy, "dualend_kv_live_sequences", "dualend_v1_backbone") == 1)
        waiting = pool.submit(stream_grpc, busy.grpc_url, "dualend", PROMPTS[2], 4000)
        time.sleep(0.6)  # queued by now, and 1.4 s from its end (the long stream takes ~7 s here)
        with pytest.raises(RequestError, match=r"\[queue_full\] server busy: 1 requests running and 1 waiting, "
                                               r"the queue \(max_queue_size 1\) is full; retry later") as full:
            stream_grpc(busy.grpc_url, "dualend", PROMPTS[1], 8)
        assert full.value.outcome == Outcome.QUEUE_FULL
        with pytest.raises(RequestError, match=r"waited 2 s in the queue \(queue_wait_s\) for a place \(1 of 2 "
                                               r"taken\) and room in the KV cache .* retry later or lower max_tokens") as late:
            waiting.result()
        assert late.value.outcome == Outcome.QUEUE_TIMEOUT
        assert not long_stream.done(), "the long stream must still be running for this test to mean anything"
        assert stream_grpc(busy.grpc_url, "dualend", PROMPTS[1], 8).output_tokens > 0  # a row as wide fits
        result = long_stream.result()
        assert result.finish_reason == "length" and result.output_tokens == 2000
        assert busy.is_ready()


def test_a_long_prompt_arriving_during_decoding_streams_beside_the_others(server, engines):
    """A prompt near the limit is prefilled in chunks of 64 tokens between decode steps: the streams
    already running keep their text, and the newcomer's text equals the engine's."""
    tokenizer = engines["dualend"].exported.tokenizer()
    long_prompt = next(sized_examples("lookup", "report", 11, tokenizer.prompt_length, 400, 440)).prompt
    jobs = [(PROMPTS[i % len(PROMPTS)], 240) for i in range(4)]  # still decoding while the newcomer runs
    with ThreadPoolExecutor(5) as pool:
        running = [pool.submit(stream_grpc, server.grpc_url, "dualend", p, n, ignore_eos=True,
                               exclude_input_in_output=True) for p, n in jobs]
        assert wait_for(lambda: metric(server, "dualend_kv_live_sequences", "dualend_v1_backbone") >= 4)
        newcomer = stream_grpc(server.grpc_url, "dualend", long_prompt, 32, exclude_input_in_output=True)
        assert not all(job.done() for job in running), "the others must still be decoding"
        results = [job.result() for job in running]
    assert newcomer.text == engine_text(server, engines, "dualend", long_prompt, 32).text
    for (prompt, max_tokens), result in zip(jobs, results):
        assert result.text == engine_text(server, engines, "dualend", prompt, max_tokens, ignore_eos=True).text


def test_three_redeploys_under_live_load_refuse_nothing_and_a_bad_repository_changes_nothing(tmp_path):
    """16 clients send requests back to back while the dual-end deployment is swapped three times
    (shipped -> nudged -> shipped -> nudged): not one request fails, each swap serves its
    checkpoint, the old version is unloaded after it drains, and a corrupt repository is refused
    before anything is loaded."""
    import shutil

    import torch

    from client.reload import ReloadError, loaded_pipelines, reload, served_checkpoint
    from dualend.engine.checkpoint import Checkpoint, load_checkpoint
    from dualend.ops.repository_api import RepositoryAPI
    from dualend.serving.repository import served_generation

    nudged = tmp_path / "checkpoints"  # a second dual-end checkpoint: the MTP head's first weight nudged
    shutil.copytree(CHECKPOINTS / "baseline", nudged / "baseline")
    shipped = load_checkpoint(CHECKPOINTS / "dualend")
    shipped_id = shipped.id
    with torch.no_grad():
        next(shipped.model.mtp.parameters()).mul_(1.01)
    nudged_id = Checkpoint(shipped.model, shipped.tokenizer, shipped.recipe).save(nudged / "dualend")
    assert nudged_id != shipped_id

    def assemble(source):
        return assemble_dualend(tmp_path, checkpoints=source)
    repository = assemble(CHECKPOINTS)
    models = ["dualend_v1_backbone", "dualend"]
    with TritonServer(repository, model_control_mode="explicit", load_models=models,
                      log_file=tmp_path / "server.log") as triton:
        api = RepositoryAPI(triton.grpc_url, None)
        assert served_checkpoint(api, "dualend") == shipped_id
        stop, done, errors, finished = threading.Event(), [], [], []

        def client(index):
            while not stop.is_set():
                try:
                    done.append(stream_grpc(triton.grpc_url, "dualend", PROMPTS[index % len(PROMPTS)], 40,
                                            ignore_eos=True).output_tokens)
                except RequestError as error:
                    errors.append(str(error))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        try:
            for source, expected in ((nudged, nudged_id), (CHECKPOINTS, shipped_id), (nudged, nudged_id)):
                assert wait_for(lambda: len(done) > 20, 60)
                assemble(source)
                assert reload(triton.grpc_url, triton.metrics_url, "dualend", repository) == expected
                assert served_checkpoint(api, "dualend") == expected
                generation = served_generation(repository, "dualend")
                assert loaded_pipelines(api, "dualend") == [f"dualend_v{generation}"]
                assert sorted(p.name for p in repository.glob("dualend_v*_backbone")) == [f"dualend_v{generation}_backbone"]
                finished += done
                done.clear()
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert errors == [] and all(tokens == 40 for tokens in finished + done)
        served_text = stream_grpc(triton.grpc_url, "dualend", PROMPTS[0], 24).text

        assemble(CHECKPOINTS)
        onnx = repository / f"dualend_v{served_generation(repository, 'dualend')}_mtp_verify" / "1" / "mtp" / "model.onnx"
        data = bytearray(onnx.read_bytes())
        data[len(data) // 2] ^= 0xFF
        onnx.write_bytes(bytes(data))
        with pytest.raises(ReloadError, match="repository is inconsistent.*mtp.*sha256"):
            reload(triton.grpc_url, triton.metrics_url, "dualend", repository)
        assert served_checkpoint(api, "dualend") == nudged_id
        assert stream_grpc(triton.grpc_url, "dualend", PROMPTS[0], 24).text == served_text

        assemble(CHECKPOINTS)  # consistent on disk, but its compressor fails to load
        broken = repository / f"dualend_v{served_generation(repository, 'dualend')}_compressor" / "1" / "model.py"
        broken.write_text(broken.read_text().replace("    def initialize(self, args):\n",
                                                     "    def initialize(self, args):\n        raise MemoryError\n"))
        with pytest.raises(ReloadError, match="loading failed; dualend keeps serving .*_compressor"):
            reload(triton.grpc_url, triton.metrics_url, "dualend", repository)
        assert served_checkpoint(api, "dualend") == nudged_id and loaded_pipelines(api, "dualend") == [
            f"dualend_v{generation}"]  # the bad generation's models were unloaded again
        assert stream_grpc(triton.grpc_url, "dualend", PROMPTS[0], 24).text == served_text
        api.close()


def test_long_http_and_grpc_streams_finish_across_a_reload(tmp_path):
    """Six 1800-token gRPC streams and six HTTP generate_stream streams across a reload, short requests
    arriving all along: the old generation unloads only after every stream got all its tokens and its
    end, and no request fails. (With the repository API called over HTTP, half of such HTTP streams
    lost every event after the load: `dualend.ops.repository_api`.)"""

    from client.api import generate_http, stream_http
    from client.reload import reload
    from dualend.ops.repository_api import RepositoryAPI

    def assemble():  # streams long enough to outlast the reload's loads
        return assemble_dualend(tmp_path, "--raw-context-limit", "2048", "--max-new-tokens", "2048")
    repository = assemble()
    with TritonServer(repository, model_control_mode="explicit", load_models=["dualend_v1_backbone", "dualend"],
                      log_file=tmp_path / "server.log") as triton:
        assemble()  # generation 2, same checkpoint
        stop, short = threading.Event(), []

        def short_requests():  # the traffic that keeps arriving during a redeploy
            while not stop.is_set():
                short.append(generate_http(triton.http_url, "dualend", PROMPTS[1], 16).output_tokens)

        def running_at_swap():  # generation 1's running sequences when the ensemble first names generation 2
            with RepositoryAPI(triton.grpc_url, None) as api:
                while not stop.is_set():
                    running = metric(triton, "dualend_running_sequences", "dualend_v1_mtp_verify")
                    if "dualend_v2_" in json.dumps(api.config("dualend")):
                        return running
                    time.sleep(0.05)
            return None

        with ThreadPoolExecutor(15) as pool:  # 12 streams, 2 senders, the swap watcher
            long = {"ignore_eos": True, "timeout_s": 60, "acceptance_threshold": 1.0}  # one token a step
            streams = [pool.submit(stream_grpc, triton.grpc_url, "dualend", PROMPTS[i % len(PROMPTS)], 1800, **long)
                       for i in range(6)]
            streams += [pool.submit(stream_http, triton.http_url, "dualend", PROMPTS[i % len(PROMPTS)], 1800, **long)
                        for i in range(6)]
            senders = [pool.submit(short_requests) for _ in range(2)]
            swapped = pool.submit(running_at_swap)
            try:
                assert wait_for(lambda: metric(triton, "dualend_running_sequences", "dualend_v1_mtp_verify") >= 12, 30)
                reload(triton.grpc_url, triton.metrics_url, "dualend", repository)
                results = [stream.result() for stream in streams]
            finally:
                stop.set()
            [sender.result() for sender in senders]
        assert (swapped.result() or 0) >= 6, swapped.result()  # the swap did happen under the long streams
        assert [r.output_tokens for r in results] == [1800] * 12 and set(short) == {16}
        assert all(r.finish_reason == "length" for r in results)


def test_a_reload_whose_drain_runs_out_keeps_the_old_generation_and_a_rerun_finishes_the_swap(tmp_path):
    """Long streams (4000 tokens) on generation 1, a reload with a 0.2 s drain: it says generation 1 still holds
    requests and leaves it loaded, new requests go to generation 2; run again (its backbone folder
    touched meanwhile, as a stub's first __pycache__ would), it loads nothing, waits for generation
    1's streams and unloads it. Every stream on either generation gets all its tokens."""
    from client.api import stream_http
    from client.reload import ReloadError, loaded_pipelines, reload
    from dualend.ops.repository_api import RepositoryAPI

    def assemble():  # streams that outlast the reload's loads by far
        return assemble_dualend(tmp_path, "--raw-context-limit", "4096", "--max-new-tokens", "4096",
                                "--max-concurrent-requests", "12")
    repository = assemble()
    version_dir = repository / "dualend_v1_backbone" / "1"
    assembled = version_dir.stat().st_mtime_ns
    with TritonServer(repository, model_control_mode="explicit", load_models=["dualend_v1_backbone", "dualend"],
                      log_file=tmp_path / "server.log") as triton, RepositoryAPI(triton.grpc_url, None) as api:
        assert version_dir.stat().st_mtime_ns == assembled  # the stub wrote nothing into its model folder
        assemble()  # generation 2, same checkpoint
        long = {"ignore_eos": True, "timeout_s": 60, "acceptance_threshold": 1.0}  # one token a step: slow
        with ThreadPoolExecutor(8) as pool:
            first = [pool.submit(stream_grpc, triton.grpc_url, "dualend", PROMPTS[0], 4000, **long) for _ in range(3)]
            first += [pool.submit(stream_http, triton.http_url, "dualend", PROMPTS[0], 4000, **long) for _ in range(2)]
            assert wait_for(lambda: metric(triton, "dualend_running_sequences", "dualend_v1_mtp_verify") >= 5, 30)
            with pytest.raises(ReloadError, match=r"serves dualend_v2, but dualend_v1 still holds requests after "
                                                  r"0.2 s \(--drain-timeout-s\), so it stays loaded"):
                reload(triton.grpc_url, triton.metrics_url, "dualend", repository, drain_timeout_s=0.2)
            assert loaded_pipelines(api, "dualend") == ["dualend_v1", "dualend_v2"]
            second = [pool.submit(stream_grpc, triton.grpc_url, "dualend", PROMPTS[0], 2000, **long) for _ in range(3)]
            assert wait_for(lambda: metric(triton, "dualend_running_sequences", "dualend_v2_mtp_verify") >= 3, 30)
            os.utime(repository / "dualend_v2_backbone" / "1")  # a load call now would reload the served backbone
            reload(triton.grpc_url, triton.metrics_url, "dualend", repository, drain_timeout_s=180)  # 5 x 4000 tokens on 2 cores
            results = [stream.result() for stream in first + second]
        assert [r.output_tokens for r in results] == [4000] * 5 + [2000] * 3
        assert loaded_pipelines(api, "dualend") == ["dualend_v2"]


@pytest.mark.parametrize("model, inputs", [
    ("dualend_v1_backbone", {"latents": np.zeros((1, 4), np.float32), "sequence_ids": np.array([1], np.int64),
                          "new_latents": np.array([1], np.int32), "reserve_slots": np.array([9999], np.int32)}),
    ("dualend_v1_compressor", {"request_params": np.array([b"{}"], object)}),
    ("dualend_v1_postprocessing", {"output_ids": np.array([5, 6], np.int64), "request_id": np.array([7], np.uint64)}),
    ("dualend_v1_postprocessing", {"output_ids": np.arange(2_000_000, dtype=np.int64) % 64,  # 16 MB
                                   "request_id": np.array([7], np.uint64)}),
])
def test_internal_models_refuse_calls_from_outside_their_pipeline(server, model, inputs):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config(model)
    if "latents" in inputs:  # the right width, so only the missing secret is wrong
        inputs["latents"] = np.zeros((1, int(config["input"][0]["dims"][-1])), np.float32)
    tensors = []
    for name, value in inputs.items():
        tensor = httpclient.InferInput(name, list(value.shape), {
            np.float32: "FP32", np.int64: "INT64", np.uint64: "UINT64", np.int32: "INT32", np.object_: "BYTES"}[value.dtype.type])
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    key = httpclient.InferInput("pipeline_key", [1], "BYTES")
    key.set_data_from_numpy(np.array([b"guess"], dtype=object))
    with pytest.raises(Exception, match=r"missing required input\(s\) \['pipeline_key'\]"):
        client.infer(model, tensors)
    started = time.monotonic()
    with pytest.raises(Exception, match=f"refused: {model} is an internal step of the dualend pipeline"):
        client.infer(model, tensors + [key])
    assert time.monotonic() - started < 2
    client.close()
    assert metric(server, "dualend_kv_live_sequences", "dualend_v1_backbone") == 0


def grpc_inputs(**arrays):
    import tritonclient.grpc as grpcclient

    kinds = {np.float32: "FP32", np.int64: "INT64", np.int32: "INT32", np.uint64: "UINT64", np.object_: "BYTES"}
    tensors = []
    for name, value in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(value.shape), kinds[value.dtype.type]))
        tensors[-1].set_data_from_numpy(value)
    return tensors


def mtp_verify_error(server, key: bytes, params: bytes | None = None, latents=None) -> str:
    """The error a request sent straight to dualend's mtp_verify with `key` gets (its stream's first
    answer): a generation of `params` and `latents`, by default a drain (a control request)."""
    import tritonclient.grpc as grpcclient

    if params is None:
        inputs = drain_request("unused") | {"pipeline_key": np.array([key], object)}
    else:
        inputs = dict(prompt_latents=latents, request_params=np.array([params], object),
                      pipeline_key=np.array([key], object))
    errors = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("dualend_v1_mtp_verify", grpc_inputs(**inputs))
    assert wait_for(lambda: errors, 10)
    client.stop_stream()
    client.close()
    return str(errors[0])


def test_mtp_verify_refuses_a_forged_drain(server):
    assert "internal step of the dualend pipeline" in mtp_verify_error(server, b"guess")
    assert stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 4).output_tokens > 0  # not drained


def test_a_client_calling_the_pipelines_steps_can_replay_only_its_own_request(server):
    """Preprocessing is the ensemble's first step, so a client can call it, and then the compressor,
    and read the keys they hand on: those keys must not drain the decode loop, reach the backbone,
    vouch for other parameters, another prompt or made-up latents (NaN latents would end every
    stream in the loop), while a stream runs undisturbed."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    prepared = client.infer("dualend_v1_preprocessing", grpc_inputs(
        text_input=np.array([PROMPTS[0].encode()], object), max_tokens=np.array([4], np.int32)))
    key, params = (prepared.as_numpy(n) for n in ("pipeline_key", "request_params"))
    refusal = "internal step of the dualend pipeline"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_grpc, server.grpc_url, "dualend", PROMPTS[1], 120, ignore_eos=True)
        assert refusal in mtp_verify_error(server, bytes(key[0]))
        with pytest.raises(Exception, match=refusal):
            client.infer("dualend_v1_backbone", grpc_inputs(
                latents=np.zeros((1, 256), np.float32), sequence_ids=np.array([1], np.int64),
                new_latents=np.array([1], np.int32), reserve_slots=np.array([9999], np.int32), pipeline_key=key))
        forged = json.loads(bytes(params[0])) | {"prompt_ids": [1] + [5] * 3000}  # another prompt
        for other in (b'{"drain": true}', json.dumps(forged).encode()):
            with pytest.raises(Exception, match=refusal):
                client.infer("dualend_v1_compressor", grpc_inputs(
                    request_params=np.array([other], object), pipeline_key=key))
        compressed = client.infer("dualend_v1_compressor", grpc_inputs(  # its own request: what the ensemble does
            request_params=params, pipeline_key=key))
        latents, latents_key = compressed.as_numpy("prompt_latents"), bytes(compressed.as_numpy("latents_key")[0])
        prompt_ids = json.loads(bytes(params[0]))["prompt_ids"]
        assert latents.shape == (-(-len(prompt_ids) // 2), 256)
        assert refusal in mtp_verify_error(server, bytes(key[0]), bytes(params[0]), latents)  # preprocessing's key
        assert refusal in mtp_verify_error(server, latents_key, bytes(params[0]), latents * np.nan)
        assert refusal in mtp_verify_error(server, latents_key)  # a drain
        assert running.result().output_tokens == 120
    client.close()
    # the loop frees the row after the stream's last response, so the gauge may lag the client by a step
    assert wait_for(lambda: metric(server, "dualend_kv_live_sequences", "dualend_v1_backbone") == 0)
    assert stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 4).output_tokens > 0  # not drained


class Launched:
    """`python -m dualend.ops.launch` as users run it (gateway in front, explicit mode, watchdog), on free
    ports, serving the dual-end deployment only."""

    def __init__(self, tmp_path):
        import subprocess
        import sys

        self.http_port, self.grpc_port, self.metrics_port, triton_http, triton_grpc = free_ports("127.0.0.1", 5)
        self.triton_grpc_port, self.tmp_path = triton_grpc, tmp_path
        self.repository = self.assemble()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dualend.ops.launch", "--model-repository", str(self.repository), "--no-source-check",
             "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
             "--metrics-port", str(self.metrics_port), "--triton-http-port", str(triton_http),
             "--triton-grpc-port", str(triton_grpc), "--api-keys", str(tmp_path / "keys"),
             "--log-file", str(tmp_path / "server.log")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        until_launcher_serves(self.process)
        self.key = (tmp_path / "keys").read_text().split()[1]
        self.server_pid = int(subprocess.check_output(["pgrep", "-P", str(self.process.pid), "tritonserver"]).split()[0])

    def assemble(self):
        """The shipped checkpoint as the next generation on disk (the first: what the launcher serves)."""
        return assemble_dualend(self.tmp_path)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.process.poll() is None:  # a test that failed half-way leaves nothing running
            self.process.terminate()
            self.process.wait(30)

    def stream(self, max_tokens, **params):
        return stream_grpc(f"127.0.0.1:{self.grpc_port}", "dualend", PROMPTS[0], max_tokens, api_key=self.key, **params)

    def live_sequences(self):
        return metric_value(f"http://127.0.0.1:{self.metrics_port}/metrics", "dualend_kv_live_sequences",
                            "dualend_v1_backbone") or 0

    def ready(self):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


def test_sigterm_ends_every_stream_with_a_clear_error_and_leaves_nothing_behind(tmp_path):
    """SIGTERM to the launcher under 16 live streams."""
    import signal
    import subprocess

    from dualend.ops.launch import EXIT_TIMEOUT_S
    from dualend.ops.processes import stub_processes

    with Launched(tmp_path) as launched:
        regions = [region for _, region in stub_processes(launched.server_pid).values()]
        assert regions
        with ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(launched.stream, 1000, ignore_eos=True, acceptance_threshold=1.0) for _ in range(16)]
            assert wait_for(lambda: launched.live_sequences() == 16, 30)
            started = time.monotonic()
            launched.process.send_signal(signal.SIGTERM)
            for stream in streams:
                with pytest.raises(RequestError, match="the server is shutting down; the stream ends here, retry") as ended:
                    stream.result()
                assert ended.value.outcome == Outcome.SHUTTING_DOWN
            ended = time.monotonic() - started
        launched.process.wait(EXIT_TIMEOUT_S + 5)
        exited = time.monotonic() - started
        assert ended < EXIT_TIMEOUT_S and exited < EXIT_TIMEOUT_S + 5 and launched.process.returncode == 0
        assert subprocess.run(["pgrep", "-f", str(launched.repository)], capture_output=True).stdout == b""
        assert not [r for r in regions if os.path.exists(f"/dev/shm/{r}")]


def test_a_tritonserver_killed_between_assemble_and_reload_is_started_again_with_the_named_generation_alone(
        tmp_path):
    """The launcher starts a dead tritonserver again as a start would: generation 2, which `builder.assemble`
    wrote and named in the ensemble, is served, and generation 1 is not loaded beside it."""
    import signal
    import subprocess

    with Launched(tmp_path) as launched:
        assemble_dualend(tmp_path)  # generation 2; no `client.reload` yet
        os.kill(launched.server_pid, signal.SIGKILL)

        def new_server():
            found = subprocess.run(["pgrep", "-P", str(launched.process.pid), "tritonserver"], capture_output=True)
            return found.stdout.split() not in ([], [str(launched.server_pid).encode()])
        assert wait_for(new_server, 30)
        assert wait_for(launched.ready, 120)
        assert launched.stream(8).output_tokens == 8
        steps = ("backbone", "compressor", "mtp_verify", "postprocessing", "preprocessing")
        generations = sorted(p.name for p in launched.repository.iterdir() if p.name.startswith("dualend_v"))
        assert generations == [f"dualend_v2_{step}" for step in steps]


def test_a_killed_backbone_is_restored_without_a_human(tmp_path):
    """kill -9 of the backbone's stub under 4 live streams: they end with an error within 5 s, the
    deployment reports not ready while the watchdog reloads it, and serves again within 15 s."""
    import signal

    from dualend.ops.processes import stub_processes

    with Launched(tmp_path) as launched:
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(launched.stream, 1000, ignore_eos=True, acceptance_threshold=1.0)
                       for _ in range(4)]
            assert wait_for(lambda: launched.live_sequences() == 4, 30)
            killed = time.monotonic()
            stub, region = stub_processes(launched.server_pid)["dualend_v1_backbone"]
            os.kill(stub, signal.SIGKILL)
            saw_not_ready = wait_for(lambda: not launched.ready(), 10, poll_s=0.02)
            for stream in streams:
                with pytest.raises(RequestError, match="backbone"):
                    stream.result()
            errors_after = time.monotonic() - killed
        assert saw_not_ready and errors_after < 5

        def serves():
            try:
                return launched.ready() and launched.stream(8).output_tokens == 8
            except RequestError:
                return False

        assert wait_for(serves, 15, poll_s=0.2)
        assert time.monotonic() - killed < 15
        assert "dualend_v1_backbone" in stub_processes(launched.server_pid)
        assert os.path.exists(f"/dev/shm/{region}")  # the killed stub's shared memory, left behind
        launched.process.terminate()
        launched.process.wait(30)
    assert not os.path.exists(f"/dev/shm/{region}")  # removed at the stop


def test_a_keys_cap_counts_its_requests_on_every_route_together(tmp_path):
    """A key with max_requests=2 holding two requests on two gRPC streams (their client stops reading,
    so they stay open) is refused a third request on every route (HTTP generate, gRPC, /v1) with the
    cap's code, counted by the service in front, while another key is served; once its streams end, it
    is served again."""
    import openai

    capped, other = "c0" * 16, "e1" * 16
    (tmp_path / "keys").write_text(f"capped {capped} max_requests=2\nother {other}\n")
    with Launched(tmp_path) as launched:
        assert launched.key == capped
        reading = threading.Event()
        http, grpc_url = f"127.0.0.1:{launched.http_port}", f"127.0.0.1:{launched.grpc_port}"
        v1 = openai.OpenAI(base_url=f"http://{http}/v1", api_key=capped, max_retries=0)
        with ThreadPoolExecutor(2) as pool:
            arrived = []

            def hold(text):
                arrived.append(text)
                reading.wait(60)

            # long enough to be decoding still when the refusals are over (40 tokens could end first)
            held = [pool.submit(launched.stream, 800, ignore_eos=True, on_text=hold) for _ in range(2)]
            try:
                assert wait_for(lambda: len(arrived) == 2, 30)  # both streams open, their readers stopped
                with pytest.raises(RequestError, match=r"^\[too_many_requests_for_key\] .*max_requests 2"):
                    generate_http(http, "dualend", PROMPTS[0], 2, api_key=capped)
                with pytest.raises(RequestError, match=r"^\[too_many_requests_for_key\] .*max_requests 2"):
                    stream_grpc(grpc_url, "dualend", PROMPTS[0], 2, api_key=capped)
                with pytest.raises(openai.RateLimitError, match="max_requests 2") as refused:
                    v1.completions.create(model="dualend", prompt=PROMPTS[0], max_tokens=2)
                assert refused.value.code == "too_many_requests_for_key"
                assert generate_http(http, "dualend", PROMPTS[0], 2, api_key=other).output_tokens == 2
            finally:
                reading.set()
            assert [stream.result(timeout=60).finish_reason for stream in held] == ["length", "length"]
        assert v1.completions.create(model="dualend", prompt=PROMPTS[0], max_tokens=2).choices


def test_a_killed_compressor_is_restored_while_http_and_grpc_streams_finish(tmp_path):
    """kill -9 of the compressor's stub under 4 HTTP and 4 gRPC streams already decoding, with a newer
    generation already assembled on disk (not swapped in): readiness goes false, the watchdog reloads
    the compressor (the ensemble is left as it is), and the deployment serves generation 1 again
    within 15 s, while every running stream gets all its tokens and its end (the reloads go over
    gRPC; over HTTP they cut HTTP streams)."""
    import signal

    from client.api import stream_http
    from dualend.ops.launch import admin_key
    from dualend.ops.processes import stub_processes
    from dualend.ops.repository_api import RepositoryAPI

    with Launched(tmp_path) as launched:
        launched.assemble()  # generation 2 on disk, not loaded
        gateway_http = f"127.0.0.1:{launched.http_port}"
        with ThreadPoolExecutor(8) as pool:
            drafting_off = {"ignore_eos": True, "acceptance_threshold": 1.0}  # one token a step: longer streams
            streams = [pool.submit(launched.stream, 1000, **drafting_off) for _ in range(4)]
            streams += [pool.submit(stream_http, gateway_http, "dualend", PROMPTS[0], 1000, timeout_s=60,
                                    api_key=launched.key, **drafting_off) for _ in range(4)]
            assert wait_for(lambda: launched.live_sequences() == 8, 30)
            killed = time.monotonic()
            os.kill(stub_processes(launched.server_pid)["dualend_v1_compressor"][0], signal.SIGKILL)
            saw_not_ready = wait_for(lambda: not launched.ready(), 10, poll_s=0.02)

            def serves():
                try:
                    return launched.ready() and launched.stream(8).output_tokens == 8
                except RequestError:
                    return False

            assert saw_not_ready and wait_for(serves, 15, poll_s=0.2)
            assert time.monotonic() - killed < 15
            assert launched.live_sequences() >= 6  # the restore, ensemble reload included, ran under the streams
            results = [stream.result() for stream in streams]
        assert [r.output_tokens for r in results] == [1000] * 8
        assert all(r.finish_reason == "length" for r in results)
        assert "dualend_v1_compressor" in stub_processes(launched.server_pid)
        with RepositoryAPI(f"127.0.0.1:{launched.triton_grpc_port}", admin_key()) as api:  # the launcher's
            assert api.serving_pipeline("dualend") == "dualend_v1"


def test_liveness_fails_while_the_watchdog_marks_a_component_it_cannot_restore(tmp_path):
    """The watchdog's mark (after STUCK_AFTER failed restores of one model, e.g. a load hung in
    tritonserver) makes the gateway's liveness answer 503, so an orchestrator restarts the server."""
    import urllib.error
    import urllib.request

    from dualend.ops.gateway import DEFAULT_PREFIX
    from dualend.ops.watchdog import STUCK_MARK

    def live():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{launched.http_port}/v2/health/live", timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    with Launched(tmp_path) as launched:
        assert live()[0] == 200
        mark = DEFAULT_PREFIX / "down" / STUCK_MARK  # where the launcher's watchdog writes it
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text("dualend_v1_compressor")
        try:
            status, body = live()
            assert status == 503 and "cannot be restored; restart the server" in body
            assert not launched.ready()  # every route refuses now: out of a Service's endpoints at once
        finally:
            mark.unlink()
        assert live()[0] == 200 and launched.ready()


def test_metrics_by_phase_add_up_after_known_requests(server):
    model = "dualend_v1_mtp_verify"
    names = ("dualend_ttft_seconds_count", "dualend_inter_token_seconds_count", "dualend_queue_seconds_count",
             "dualend_prefill_seconds_count", "dualend_tokens_per_step_sum", "dualend_tokens_per_step_count",
             "dualend_output_tokens", "dualend_decode_steps")
    before = {name: metric(server, name, model) or 0 for name in names}
    refused_before = metric_value(server.metrics_url, "dualend_requests_refused", model)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: stream_grpc(server.grpc_url, "dualend", PROMPTS[i], 20, ignore_eos=True,
                                                      exclude_input_in_output=True), range(6)))
    tokens = sum(r.output_tokens for r in results)

    def delta():  # the loop pushes its metrics when it goes idle, a moment after the last response
        return {name: (metric(server, name, model) or 0) - before[name] for name in names}

    assert wait_for(lambda: delta()["dualend_ttft_seconds_count"] == 6 and delta()["dualend_output_tokens"] == tokens)
    assert metric(server, "dualend_running_sequences", model) == 0
    delta = delta()
    first_response_tokens = sum(next(n for _, n in r.arrivals if n) for r in results)
    assert tokens == 120 and delta["dualend_output_tokens"] == tokens
    assert delta["dualend_ttft_seconds_count"] == delta["dualend_queue_seconds_count"] == 6
    assert delta["dualend_prefill_seconds_count"] == 6
    assert delta["dualend_inter_token_seconds_count"] + first_response_tokens == tokens
    assert delta["dualend_tokens_per_step_sum"] == tokens
    assert delta["dualend_tokens_per_step_count"] == delta["dualend_decode_steps"]
    assert metric_value(server.metrics_url, "dualend_requests_refused", model) == refused_before


MALFORMED = [  # (case, change to a good body {"text_input", "max_tokens"}, what the error must say)
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens must be between 1 and 256, got 0"),
    ("max_tokens negative", {"max_tokens": -1}, "max_tokens must be between 1 and 256, got -1"),
    ("max_tokens over the limit", {"max_tokens": 257}, "max_tokens must be between 1 and 256, got 257"),
    ("max_tokens int32 max", {"max_tokens": 2 ** 31 - 1}, "max_tokens must be between 1 and 256"),
    ("temperature negative", {"temperature": -1.0}, "temperature must be >= 0"),
    ("temperature slightly negative", {"temperature": -0.001}, "temperature must be >= 0"),
    ("temperature overflows fp32", {"temperature": 1e39}, "temperature must be >= 0.*got inf"),
    ("top_k negative", {"top_k": -1}, "top_k must be >= 0"),
    ("top_k very negative", {"top_k": -100}, "top_k must be >= 0"),
    ("top_p zero", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("top_p negative", {"top_p": -0.5}, r"top_p must be in \(0, 1\]"),
    ("top_p just above one", {"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
    ("top_p two", {"top_p": 2.0}, r"top_p must be in \(0, 1\]"),
    ("acceptance_threshold overflows", {"acceptance_threshold": 1e39}, "acceptance_threshold must be a finite number"),
    ("stop word empty", {"stop_words": [""]}, "stop_words must not contain an empty string"),
    ("stop words with an empty one", {"stop_words": ["#", ""]}, "stop_words must not contain an empty string"),
    ("text empty", {"text_input": ""}, "text_input is empty"),
    ("text only whitespace", {"text_input": "   \n\t "}, "text_input is empty"),
    ("prompt over the limit", {"text_input": "1+2 " * 800}, "no room for a new token within raw_context_limit 512.*never truncated"),
    ("too many stop words", {"stop_words": [f"w{i}" for i in range(33)]}, "stop_words holds 33 words, at most 32"),
    ("a stop word too long", {"stop_words": ["x" * 257]}, "a stop word is 257 characters long, at most 256"),
    ("acceptance_threshold above 1", {"acceptance_threshold": 2.0}, "acceptance_threshold must be from -1"),
    ("acceptance_threshold below -1", {"acceptance_threshold": -1.5}, "acceptance_threshold must be from -1"),
    ("prompt + max_tokens over the limit", {"text_input": "1+2 " * 100, "max_tokens": 200},
     "exceeds raw_context_limit 512; lower max_tokens"),
    ("prompt over the byte bound", {"text_input": "x" * 200000}, "prompt is 200000 bytes"),
    ("text_input missing", {"text_input": None}, r"missing required input\(s\) \['text_input'\]"),
    ("max_tokens missing", {"max_tokens": None}, r"missing required input\(s\) \['max_tokens'\]"),
    ("two texts", {"text_input": ["a", "b"]}, "input 'text_input' to tensor with proper shape"),
    ("two max_tokens", {"max_tokens": [1, 2]}, "input 'max_tokens' to tensor with proper shape"),
    ("two temperatures", {"temperature": [0.1, 0.2]}, "input 'temperature' to tensor with proper shape"),
]


def _post(server, path, body):
    import http.client
    import json

    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", path, body=json.dumps(body))
    response = connection.getresponse()
    return response.status, response.read().decode()


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize("case, change, message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_request_is_a_400_that_names_the_problem(server, endpoint, case, change, message):
    body = {"text_input": "Q: 1+2\nA:", "max_tokens": 4}
    for name, value in change.items():
        if value is None:
            body.pop(name)
        else:
            body[name] = value
    status, text = _post(server, f"/v2/models/dualend/{endpoint}", body)
    assert status == 400 and re.search(message, text), (status, text)


GRPC_MALFORMED = [c for c in MALFORMED if None not in c[1].values() and not c[0].startswith("two ")]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e39 as FP32, on purpose
@pytest.mark.parametrize("case, change, message", GRPC_MALFORMED, ids=[c[0] for c in GRPC_MALFORMED])
def test_a_malformed_grpc_request_is_refused_naming_the_problem(server, case, change, message):
    params = {k: v for k, v in change.items() if k not in ("text_input", "max_tokens")}
    with pytest.raises(RequestError, match=message):
        stream_grpc(server.grpc_url, "dualend", change.get("text_input", "Q: 1+2\nA:"), change.get("max_tokens", 4),
                    **params)
    assert stream_grpc(server.grpc_url, "dualend", PROMPTS[0], 4).output_tokens > 0  # the server stays up


@pytest.mark.parametrize("precision", ["int4", "w8a8"])
def test_a_quantized_deployment_writes_its_keys_in_place_and_serves_the_engines_text(tmp_path, precision):
    """int4 or w8a8 weights: the backbone is the fused graph, whose GroupQueryAttention writes each step's keys
    into the KV buffers in place. Served one request at a time (prompts prefilled in chunks) its text
    equals the in-process engine's on the same export; eight at once (rows stepping together, prompts
    prefilled between the steps) all run to their length and free their KV."""
    from builder.export import FUSED_GRAPH

    repository = assemble_main(["--checkpoints", str(CHECKPOINTS), "--out", str(tmp_path / "repository"),
                                "--export-dir", str(tmp_path / "export"), "--deployments", "baseline",
                                "--variant", "quantized=baseline", "--weight-precision", f"quantized={precision}",
                                "--prefill-chunk-tokens", "16", "--max-concurrent-requests", "8"])
    engine = OnnxComponents(tmp_path / "export" / f"baseline_{precision}")
    assert engine.exported.settings["backbone_graph"] == FUSED_GRAPH and engine.backbone.writes_in_place
    tokenizer = engine.exported.tokenizer()
    with TritonServer(repository, log_file=tmp_path / "server.log") as triton, ThreadPoolExecutor(8) as pool:
        for prompt in PROMPTS[:3]:
            expected = generate_text(engine, tokenizer, prompt, SamplingParams(max_tokens=40), 1.0)
            assert stream_grpc(triton.grpc_url, "quantized", prompt, 40, exclude_input_in_output=True).text == expected.text
        lengths = [20 + 9 * i for i in range(8)]
        results = list(pool.map(lambda i: stream_grpc(triton.grpc_url, "quantized", PROMPTS[i % len(PROMPTS)], lengths[i],
                                                      exclude_input_in_output=True, ignore_eos=True), range(8)))
        assert [result.output_tokens for result in results] == lengths
        assert wait_for(lambda: metric(triton, "dualend_kv_live_sequences", "quantized_v1_backbone") == 0)
