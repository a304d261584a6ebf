"""The server's own settings (beside the engine's): who may call, the limits every request is held to, and its role
in prefill/decode disaggregation."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp",)


@dataclass(frozen=True)
class ServerOptions:
    """Flags of `kestrel serve` that are the server's, not the engine's. Every limit is answered in OpenAI's error
    shape: 401 for a missing or wrong key, 429 past a queue or per-key limit, 408 past the request timeout."""

    model_name: str
    api_keys: tuple[str, ...] = ()                       # none: no authentication
    max_queued_requests: int | None = None               # requests waiting for a slot, beyond which 429
    max_concurrent_requests_per_key: int | None = None   # open generation requests per API key, beyond which 429
    request_timeout: float | None = None                 # seconds from arrival; then aborted with 408
    shutdown_timeout: float = 30.0                       # seconds SIGTERM waits for running requests, then aborts
    disaggregation_mode: str = "null"                    # SGLang's names: null (unified), prefill, decode
    disaggregation_bootstrap_port: int = 8998            # prefill: where decode instances find it
    disaggregation_transfer_backend: str = "tcp"
    disaggregation_timeout: float = 300.0                # seconds one side waits for the other's half of a handoff
    bootstrap_bind_host: str = "127.0.0.1"               # the address the bootstrap port listens on (serve's --host)

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_concurrent_requests_per_key"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout}.")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}.")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, got "
                             f"{self.disaggregation_mode!r}.")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend!r} is not "
                             f"available in kestrel; use one of {', '.join(TRANSFER_BACKENDS)}.")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be a TCP port, got "
                             f"{self.disaggregation_bootstrap_port}.")
        if not self.disaggregation_timeout > 0:
            raise ValueError(f"--disaggregation-timeout must be positive, got {self.disaggregation_timeout}.")
        if self.max_concurrent_requests_per_key is not None and not self.api_keys:
            raise ValueError("--max-concurrent-requests-per-key needs at least one --api-key to count by.")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--served-model-name", default=None,
                            help="the model name clients use (default: --model; k3.1-tiny for the bundled model)")
        parser.add_argument("--api-key", action="append", default=[], dest="api_keys",
                            help="require 'Authorization: Bearer KEY' (repeat for several keys; default: no "
                                 "authentication)")
        parser.add_argument("--max-queued-requests", type=int, default=None,
                            help="answer 429 beyond this many requests waiting to run (default: no limit)")
        parser.add_argument("--max-concurrent-requests-per-key", type=int, default=None,
                            help="answer 429 to an API key beyond this many open generation requests (default: no "
                                 "limit)")
        parser.add_argument("--request-timeout", type=float, default=None,
                            help="abort a request this many seconds after it arrives, answered 408 (default: never)")
        parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                            help="seconds SIGTERM lets running requests finish before aborting them")
        pd = parser.add_argument_group("prefill/decode disaggregation (SGLang's flags; front with "
                                       "sglang_router.launch_router --pd-disaggregation)")
        pd.add_argument("--disaggregation-mode", choices=DISAGGREGATION_MODES, default="null",
                        help="null: prefill and decode here; prefill: compute prompts and hand them to decode "
                             "instances; decode: continue prompts handed over by prefill instances")
        pd.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                        help="prefill: the port decode instances fetch handed-off requests from")
        pd.add_argument("--disaggregation-transfer-backend", default="tcp",
                        help="how the caches move: tcp (NIXL and Mooncake are not supported)")
        pd.add_argument("--disaggregation-timeout", type=float, default=300.0,
                        help="seconds either side waits for the other half of a handoff before failing the "
                             "request")

    @classmethod
    def from_cli(cls, args: argparse.Namespace, model_name: str) -> ServerOptions:
        return cls(model_name, tuple(args.api_keys), args.max_queued_requests, args.max_concurrent_requests_per_key,
                   args.request_timeout, args.shutdown_timeout, args.disaggregation_mode,
                   args.disaggregation_bootstrap_port, args.disaggregation_transfer_backend,
                   args.disaggregation_timeout, args.host)
