"""The HTTP library every API-serving role uses: the OpenAI-compatible app over an engine.

Module map:

- ``protocol``  OpenAI request and response schemas, strictly checked
- ``errors``    error bodies and status codes (from ``mlxcel.error_codes``)
- ``serving``   completions and chat completions: streaming (SSE) and not
- ``router``    the API's routes
- ``app``       ``create_app``: the FastAPI app, access control and metrics wired in
- ``access``    API keys, the fail-closed bind policy, ``--api-key-file`` and friends
- ``tls``       HTTPS certificate and key files
- ``metrics``   ``/metrics`` (Prometheus text)
- ``runtime``   ``ServerConfig`` and ``ServerRuntime``: readiness, load thread, the engine once loaded
- ``serve``     ``serve_openai``: the app on a role's bound socket until stopped

No role lives here (``mlxcel/entrypoints/``), and nothing here imports one.
"""
