"""tritonserver's model-repository API (index, load, unload) and model config, over gRPC.

The launcher's tools (`client.reload`, the watchdog) go through gRPC, never HTTP: tritonserver 2.51
runs an HTTP load or unload on one of its HTTP worker threads for as long as the load takes, and the
`generate_stream` events of the HTTP streams that thread serves are lost for good (10 concurrent
900-token HTTP streams, a redeploy's loads over HTTP: 5 of 10 stopped at the load and never ended;
the same loads over gRPC: 24 of 24 finished). The repository API needs the server's admin key.
"""
from __future__ import annotations

import json
import time

from dualend.serving.model_config import ensemble_pipeline

from .host import TO_LOCAL_SERVER

ADMIN_HEADER = "dualend-admin-key"
GRPC_PROTOCOL_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # how tritonserver reads a restricted gRPC key


class RepositoryAPI:
    def __init__(self, grpc_url: str, admin_key: str | None, timeout_s: float = 300.0):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(grpc_url, channel_args=TO_LOCAL_SERVER)
        self.headers = {GRPC_PROTOCOL_HEADER: admin_key} if admin_key else None
        self.timeout_s = timeout_s

    def index(self) -> list[dict]:
        """Every model in the repository: {"name", "version", "state", "reason"} (a model never
        loaded has no state)."""
        return self.client.get_model_repository_index(headers=self.headers, as_json=True).get("models", [])

    def ready_models(self) -> list[str]:
        return [m["name"] for m in self.index() if m.get("state") == "READY"]

    def load(self, model: str, config: dict | None = None) -> None:
        """Loads (or reloads) `model`; with `config`, that config instead of the one on disk (so an
        ensemble can be reloaded as it is served while the disk already names a newer generation)."""
        self.client.load_model(model, headers=self.headers, client_timeout=self.timeout_s,
                               config=None if config is None else json.dumps(config))

    def replace(self, model: str) -> None:
        """Loads a new instance of a loaded model, which takes over from the old one once ready (for
        a model whose stub died). Triton skips a load whose files and config are unchanged, so the
        served config goes with a `restored_at` parameter; unlike unload + load, the model never goes
        away, so an ensemble using it keeps serving (and is not reloaded by Triton)."""
        config = self.config(model)
        config.setdefault("parameters", {})["restored_at"] = {"string_value": repr(time.time())}
        self.load(model, config)

    def unload(self, model: str) -> None:
        self.client.unload_model(model, headers=self.headers, client_timeout=self.timeout_s)

    def config(self, model: str) -> dict:
        return self.client.get_model_config(model, headers=self.headers, as_json=True)["config"]

    def serving_pipeline(self, deployment: str) -> str | None:
        """The pipeline the loaded ensemble runs, e.g. "dualend_v2"; None when it is not loaded."""
        from tritonclient.utils import InferenceServerException

        try:
            return ensemble_pipeline(self.config(deployment))
        except InferenceServerException:  # not loaded
            return None

    def is_ready(self, model: str) -> bool:
        return self.client.is_model_ready(model, headers=self.headers)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "RepositoryAPI":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
