"""scripts/serve.py as a real server on 127.0.0.1, for the tests that drive it over HTTP."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from support import REPO_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The server over model_path with the tests' small settings and `extra` flags. log_dir:
    where its output goes (default: beside model_path); env: variables set (or, given None,
    unset) in its environment; api_key: what its `client` (the official openai client) sends; name: the
    --served-model-name (None: the server's default)."""

    def __init__(self, model_path, *extra, log_dir=None, env=None, api_key="none", name="tiny"):
        import openai

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_path = os.path.join(log_dir or os.path.dirname(model_path), f"server-{self.port}.log")
        self.log = open(log_path, "w+")  # noqa: SIM115 - the server's output while it runs; stop() closes it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(REPO_ROOT, "scripts", "serve.py"),
                "--model-path",
                model_path,
                "--port",
                str(self.port),
                "--attention-backend",
                "reference",
                "--skip-warmup",
                "--page-size",
                "4",
                "--max-total-tokens",
                "4096",
                *(["--served-model-name", name] if name else []),
                "--max-running-requests",
                "40",
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        else:
            raise RuntimeError(f"server did not come up: {self.output()}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def get(self, path, headers=None):
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()

    def post_raw(self, path, data: bytes, headers=None):
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> bool:
        """SIGTERM; True if the server shut down cleanly in time (uvicorn re-raises the signal after
        its graceful shutdown, so a clean exit is code 0 or -SIGTERM with the shutdown logged)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
            return code in (0, -signal.SIGTERM) and "shutting down" in self.output()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


async def streamed_text(client, prompt: str, max_tokens: int) -> str:
    """A greedy streamed completion's text, read to its end (client: openai.AsyncOpenAI)."""
    text = ""
    async for ch in await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        text += ch.choices[0].text if ch.choices else ""
    return text


async def hang_up(client, prompt: str, after_chunks: int = 3) -> None:
    """A long streamed completion that the client leaves after a few chunks."""
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    n = 0
    async for _ in stream:
        n += 1
        if n == after_chunks:
            break
    await stream.close()


def assert_idle_without_leaks(server: "Server", timeout: float = 30) -> None:
    """Waits for the server's engine to hold no request, then checks every KV page and request
    slot is back (free, or cached in the prefix tree)."""
    deadline = time.time() + timeout
    while True:
        state = json.loads(server.get("/debug/state"))
        if state["requests"] == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert state["requests"] == 0 and state["running"] == 0, state
    assert state["kv_pages_free"] + state["kv_pages_cached"] == state["kv_pages_total"], state
    assert state["request_slots_free"] == state["request_slots_total"], state
