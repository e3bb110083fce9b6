"""The server process under uvicorn, and how it ends: SIGINT or SIGTERM drain it, they do not kill it.

On the first signal the server stops admitting (new requests get 503 with a JSON error, /health answers 503)
and keeps serving what is in flight for ``shutdown_timeout`` seconds. Then it aborts the rest: each open stream
ends with an error event (the request was aborted) and ``data: [DONE]``, each waiting non-streamed request gets
a 503, and their KV pages are freed at the engine's next step. Once nothing is in flight (or ABORT_WAIT_S after
the abort) uvicorn closes the connections, the model is closed (its engine thread ends between steps) and the
process exits 0: no thread is left inside a step while the interpreter finalises. A second signal exits at once.

uvicorn's own handler would end the server at the first signal, cancel the streams after its graceful timeout
and re-raise the signal once it is done (exit status 130 or 143); :class:`DrainingServer` replaces it."""
from __future__ import annotations

import logging
import sys
import time
from types import FrameType

import uvicorn

from .app import Server

log = logging.getLogger("tllm_spec.serve")
ABORT_WAIT_S = 1.5  # after the abort, how long the streams may take to send their last events
CLOSE_TIMEOUT_S = 0.5  # uvicorn's graceful timeout once nothing is in flight (idle keep-alive connections)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that prints one line once it listens and drains on SIGINT / SIGTERM (module docstring).
    ``api``: the app's :class:`Server` (admission and the requests in flight)."""

    def __init__(self, config: uvicorn.Config, api: Server, shutdown_timeout: float, announce: str):
        config.timeout_graceful_shutdown = CLOSE_TIMEOUT_S
        super().__init__(config)
        self.api, self.shutdown_timeout, self.announce = api, shutdown_timeout, announce
        self.draining_since: float | None = None
        self.aborted_at: float | None = None

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"{self.announce} on http://{self.config.host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining_since is None and not self.should_exit:
            self.draining_since = time.monotonic()
            self.api.admission.closed = True
            print(f"shutting down: {self.api.admission.num_in_flight} request(s) in flight may take up to "
                  f"{self.shutdown_timeout:g} s to finish (signal again to exit now)", file=sys.stderr, flush=True)
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.draining_since is not None and self._drained()

    def _drained(self) -> bool:
        """Whether the drain is over; aborts what is in flight once the grace period has passed."""
        if self.api.admission.num_in_flight == 0:
            return True
        now = time.monotonic()
        if self.aborted_at is None and now - self.draining_since >= self.shutdown_timeout:
            self.aborted_at = now
            log.warning("shutdown: aborting %d request(s) still in flight", self.api.abort_all())
        return self.aborted_at is not None and now - self.aborted_at >= ABORT_WAIT_S
