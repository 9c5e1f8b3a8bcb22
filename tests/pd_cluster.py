"""A disaggregated prefill/decode cluster for the tests and benchmarks: the regional tier's stand-in.

    RegionalRecorder (the llm-d gateway: keys, headers, drops) --> PDSidecar --> prefill vLLM (kv_producer)
                                                                          \\--> decode vLLM (kv_consumer)

Two real vLLM CPU servers share a folder through vLLM's ExampleConnector: the prefill server stores each
prompt's KV there, the decode server loads it instead of computing it (whole 128-token blocks only: a
shorter prompt has nothing to transfer and is computed on the decode side). The sidecar follows llm-d's
P/D flow (its decode-side routing sidecar): the request goes to prefill with `max_tokens=1`, no stream and
`kv_transfer_params` asking for a remote decode, then the whole request, with whatever transfer parameters
prefill answered, goes to decode, whose answer (streamed when asked) is the client's.

It stands in for llm-d in tests; it is not part of the product (packaging/regional/ is what a platform
team deploys). Why not llm-d itself: it needs Kubernetes and a GPU transfer (NIXL); the connector here is
the CPU one, the flow and the headers are the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from appliance.engine.args import engine_env
from tests import loopback
from tests.support import default_model_path, free_port, serve_in_thread, shared_engine_cache, wait_for

INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")
# What llm-d's sidecar sends the prefill side (vLLM's P/D request fields): compute, keep the KV for a
# remote decode, answer at once.
PREFILL_TRANSFER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
# Sampling fields that cannot hold with a one-token prefill.
NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "n", "best_of", "max_completion_tokens")
BLOCK = 128  # the CPU backend's KV block, the connector's unit of transfer
MAX_MODEL_LEN = 2048
# ExampleConnector stores a prompt's KV from the step that first schedules it, so a prompt prefilled in
# chunks is stored short, and decode then crashes loading it ("shape mismatch: value tensor of shape
# [1024, 3, 128] ... [1280, 3, 128]": bench/outbox.py found it, 4 prompts at once). One prompt per step,
# with a step budget that holds the longest, keeps every prompt in one piece. A prefill server does this
# for real too: it has nothing to decode to interleave with.
PREFILL_ARGS = ("--max-num-seqs", "1", "--max-num-batched-tokens", str(MAX_MODEL_LEN))


SERVERS: list[VllmServer] = []  # the live ones: a failed test's report carries their log tails (conftest)


class VllmServer:
    """One real vLLM OpenAI server on 127.0.0.1 (a cluster pod), its log in a file."""

    COMMAND: tuple[str, ...] = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")

    def __init__(self, directory: Path, role: str, storage: Path, served_name: str,
                 kv_cache_bytes: int = 512 << 20, extra_args: tuple[str, ...] = ()) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.role = role
        self.log_path = directory / f"vllm-{role}.log"
        transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        self._args = ["--model", str(default_model_path()), "--served-model-name", served_name,
                      "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(kv_cache_bytes),
                      "--enforce-eager", "--disable-uvicorn-access-log", "--kv-transfer-config", json.dumps(transfer),
                      *extra_args]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (written by the child until stop())
        self._spawn()
        SERVERS.append(self)

    def _spawn(self) -> None:
        self.port = free_port()
        self._log.flush()
        self._log_start = self.log_path.stat().st_size  # where this start's log begins
        argv = [*self.COMMAND, "--host", "127.0.0.1", "--port", str(self.port), *self._args]
        # the appliance's own engine environment: offline, its ZeroMQ sockets in a folder of its own
        env = engine_env(os.environ, shared_engine_cache(), Path(tempfile.mkdtemp(prefix="pd-")))
        # A session of its own, so stop() takes vLLM's engine-core child with it.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600, port_retries: int = 2) -> None:
        """Ready, or an AssertionError with its log. Its port is picked before vLLM binds it, tens of seconds
        later, and another process may bind it first (free_port keeps only this process's own servers
        apart): vLLM then exits with EADDRINUSE, and is started again on another port."""
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.role} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return loopback.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        for retry in range(port_retries + 1):
            try:
                wait_for(up, timeout, interval=1, what=f"vLLM {self.role} on {self.url}", explain=self.log_tail)
                return
            except AssertionError:
                this_start = self.log_path.read_bytes()[self._log_start:]
                if retry == port_retries or self.proc.poll() is None or b"Address already in use" not in this_start:
                    raise
                self._log.write(f"\n*** port {self.port} was taken; starting again on another ***\n".encode())
                self._log.flush()
                self._spawn()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def injected(self) -> list[int]:
        """Tokens loaded from transferred KV, one entry per request that loaded any (the connector's log)."""
        return [int(n) for n in INJECTED.findall(self.log_text())]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus counter's samples matching labels, from the server's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = loopback.get(f"{self.url}/metrics", timeout=10).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        if self in SERVERS:
            SERVERS.remove(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@dataclass(frozen=True)
class Hop:
    """One request the sidecar sent on: to which side, and what came back."""
    side: str  # "prefill" | "decode"
    status: int
    body: dict = field(repr=False)
    at: float = field(default_factory=time.time)
    prompt_tokens: int | None = None  # from a non-streamed answer's usage


class PDSidecar:
    """llm-d's P/D flow on an OpenAI route: prefill (max_tokens=1) on one server, then decode on the other."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.skip_prefill = False  # a broken flow, for the tests that show the transfer check can fail
        self.hops: list[Hop] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"]),
                                Route("/v1/completions", self._complete, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        self._server = serve_in_thread(app)
        self.port = self._server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the server's loop, where it is used
            self._client = loopback.async_client(timeout=300)
        return self._client

    def _hop(self, side: str, status: int, body: dict, answer: bytes | None = None) -> None:
        prompt_tokens = None
        if status == 200 and answer is not None:
            with contextlib.suppress(ValueError, AttributeError):
                prompt_tokens = json.loads(answer).get("usage", {}).get("prompt_tokens")
        with self._lock:
            self.hops.append(Hop(side, status, body, prompt_tokens=prompt_tokens))

    def sent(self, side: str) -> list[Hop]:
        with self._lock:
            return [h for h in self.hops if h.side == side]

    async def _models(self, request: Request) -> Response:
        r = await self._http().get(f"{self.decode_url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def _complete(self, request: Request) -> Response:
        try:
            return await self._p_then_d(await request.json(), request.url.path)
        except httpx.HTTPError as e:  # a server down or gone: what a gateway answers, not a traceback
            return JSONResponse({"error": {"message": f"P/D sidecar: {type(e).__name__}: {e}",
                                           "type": "upstream_error"}}, status_code=502)

    async def _p_then_d(self, body: dict, path: str) -> Response:
        transfer = None
        if not self.skip_prefill:
            prefill = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
            prefill.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_TRANSFER)
            r = await self._http().post(f"{self.prefill_url}{path}", json=prefill)
            self._hop("prefill", r.status_code, prefill)
            if r.status_code != 200:  # as llm-d's sidecar: the prefill side's refusal is the answer
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            transfer = r.json().get("kv_transfer_params")  # None from ExampleConnector: the folder is the channel
        decode = dict(body, kv_transfer_params=transfer) if transfer else dict(body)
        upstream = await self._http().send(self._http().build_request("POST", f"{self.decode_url}{path}",
                                                                       json=decode), stream=True)
        if not body.get("stream") or upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self._hop("decode", upstream.status_code, decode, content)
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        self._hop("decode", upstream.status_code, decode)
        return StreamingResponse(upstream.aiter_raw(), status_code=200, media_type="text/event-stream",
                                 background=BackgroundTask(upstream.aclose))

    def close(self) -> None:
        self._server.stop()


@dataclass(frozen=True)
class Transfer:
    decode_requests: int  # answered by decode
    transferable: int  # of those, prompts with at least one whole block to transfer
    loaded: int  # requests decode loaded transferred KV for (its connector's log)
    tokens_loaded: int  # prompt tokens decode did not compute (vLLM's own counter)
    prompt_tokens: int  # prompt tokens decode was given in all

    def __str__(self) -> str:
        return (f"{self.loaded}/{self.decode_requests} decode requests used transferred KV "
                f"({self.loaded / max(self.transferable, 1):.0%} of the {self.transferable} with a whole "
                f"{BLOCK}-token block to transfer); {self.tokens_loaded}/{self.prompt_tokens} prompt tokens "
                f"({self.tokens_loaded / max(self.prompt_tokens, 1):.0%}) loaded, not computed")


class PDCluster:
    """Prefill and decode vLLM servers on one shared KV folder, and the sidecar in front of them."""

    def __init__(self, directory: Path, served_name: str) -> None:
        self.storage = directory / "kv-store"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.prefill = VllmServer(directory, "kv_producer", self.storage, served_name, extra_args=PREFILL_ARGS)
        self.decode = VllmServer(directory, "kv_consumer", self.storage, served_name, extra_args=("--max-num-seqs", "16"))
        self.sidecar = PDSidecar(self.prefill.url, self.decode.url)

    def wait_ready(self) -> None:
        self.prefill.wait_ready()
        self.decode.wait_ready()
        # a pod that had to start again on another port (VllmServer.wait_ready) is found there
        self.sidecar.prefill_url, self.sidecar.decode_url = self.prefill.url, self.decode.url

    @property
    def url(self) -> str:
        return self.sidecar.url

    def transfer(self) -> Transfer:
        """How much of decode's work came from transferred KV, so far."""
        decodes = [h for h in self.sidecar.sent("decode") if h.status == 200]
        return Transfer(
            decode_requests=len(decodes),
            # a prompt's KV moves in whole blocks of its first len - 1 tokens (ExampleConnector)
            transferable=sum(1 for h in decodes if (h.prompt_tokens or 0) > BLOCK),
            loaded=len(self.decode.injected()),
            tokens_loaded=int(self.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")),
            prompt_tokens=int(self.decode.metric("vllm:prompt_tokens_total")))

    def exited(self) -> list[str]:
        """What has died, with its log's last lines: a dead server answers nothing, and waiting is pointless."""
        return [f"vLLM {v.role} exited with {v.proc.returncode}:\n{v.log_tail()}"
                for v in (self.prefill, self.decode) if v.proc.poll() is not None]

    def stop(self) -> None:
        self.sidecar.close()
        for server in (self.decode, self.prefill):
            server.stop()
