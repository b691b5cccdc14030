"""The OpenAI-compatible API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) in front of the
deployments: `app` (the ASGI service), `translation` (request and response shapes), `front` (a cap per
API key, the end of requests whose deployment failed). Run by the launcher behind the gateway."""
