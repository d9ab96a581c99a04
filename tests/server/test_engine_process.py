"""`jspec serve` with its engine in a process of its own (engine/engine_process.py), as a real
server: the engine runs in a child of the server's process; concurrent greedy streams equal
jspec.generate, sent in chunks of three tokens (--stream-interval 3), and clients that hang up
leave no KV held; the routes that read the engine
(/get_server_info, /metrics, /debug/state, LoRA loading) answer through the pipe; a checkpoint
that is not there fails start-up with its reason; SIGTERM and SIGINT stop both processes.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file
from support import REPO_ROOT
from support.server import Server, assert_idle_without_leaks, free_port, hang_up, streamed_text

import jspec
from jspec.checkpoint.tiny import make_tiny_model

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

openai = pytest.importorskip("openai")
LORA_FLAGS = ("--max-loras-per-batch", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("proc") / "tiny"), seed=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, *LORA_FLAGS, "--stream-interval", "3")
    yield s
    assert s.stop()


def debug_state(srv) -> dict:
    return json.loads(srv.get("/debug/state"))


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def gone(pid: int, timeout: float = 30) -> bool:
    """The process exited and was reaped (or is a zombie about to be)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_the_engine_runs_in_a_child_and_the_routes_read_it(server):
    state = debug_state(server)
    assert state["engine_pid"] != server.proc.pid and parent_pid(state["engine_pid"]) == server.proc.pid
    assert os.path.exists(f"/proc/{state['engine_pid']}/task/{state['engine_thread_id']}")
    # The engine's process counts its collections since it settled its heap (engine/heap.py).
    assert set(state["gc"]) == {"count", "total_ms", "max_ms"} and len(state["gc"]["count"]) == 3
    info = json.loads(server.get("/get_server_info"))
    assert (info["model"], info["page_size"], info["context_length"], info["max_running_requests"]) == (
        "tiny",
        4,
        512,
        40,
    )
    assert info["device_kind"] and info["speculative"] is None and info["overlap_schedule"]
    metrics = server.get("/metrics")
    assert f"jspec_kv_pages_total {float(state['kv_pages_total'])}" in metrics
    assert "jspec_num_requests_running 0.0" in metrics
    assert [m.id for m in server.client.models.list().data] == ["tiny"]


def test_concurrent_greedy_streams_match_generate_and_leavers_free_their_kv(server, model_dir):
    prompts = [f"process {i}: " + "ab" * (i % 5) for i in range(12)]
    ref = jspec.generate(
        model_dir,
        prompts,
        max_new_tokens=16,
        page_size=4,
        max_total_tokens=4096,
        max_running_requests=40,
        attention_backend="reference",
        max_loras_per_batch=2,
        max_lora_rank=8,
    )
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def main():
        return await asyncio.gather(
            *[streamed_text(client, p, 16) for p in prompts], *[hang_up(client, f"leaver {i}") for i in range(4)]
        )

    texts = asyncio.run(main())[: len(prompts)]
    assert texts == [r.text for r in ref]
    assert_idle_without_leaks(server)


def write_adapter(path, cfg, rank=4, seed=1) -> str:
    """A random PEFT adapter on q_proj and v_proj, large enough to move the tiny model's tokens."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, fan_out in (("q_proj", cfg.q_size), ("v_proj", cfg.kv_size)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            fan_in = cfg.hidden_size
            tensors[f"{prefix}.lora_A.weight"] = (rng.normal(size=(rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(size=(fan_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def test_lora_adapters_load_and_unload_through_the_process(server, model_dir, tmp_path):
    path = write_adapter(tmp_path / "adapter", jspec.load(model_dir).cfg)

    def complete(model):
        r = server.client.completions.create(model=model, prompt=[5, 9, 33, 70], max_tokens=8, temperature=0)
        return r.choices[0].text

    base = complete("tiny")
    code, body = server.post_raw("/load_lora_adapter", json.dumps({"lora_name": "a", "lora_path": path}).encode())
    assert code == 200 and body["loaded_adapters"] == {"a": path}
    assert [m.id for m in server.client.models.list().data] == ["tiny", "tiny:a"]
    adapted = complete("tiny:a")
    assert adapted != base and complete("tiny:a") == adapted
    code, body = server.post_raw(
        "/load_lora_adapter", json.dumps({"lora_name": "b", "lora_path": "/nonexistent"}).encode()
    )
    assert code == 400 and "no adapter_config.json" in body["error"]["message"]
    code, body = server.post_raw("/unload_lora_adapter", json.dumps({"lora_name": "a"}).encode())
    assert code == 200 and body["loaded_adapters"] == {}
    with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'a'"):
        complete("tiny:a")
    assert complete("tiny") == base


def test_a_missing_checkpoint_fails_start_up_with_its_reason(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "scripts", "serve.py"),
            "--model-path",
            missing,
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "jspec serve: error:" in r.stderr and "no-such-model" in r.stderr.splitlines()[-1], r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_both_processes(model_dir, sig):
    srv = Server(model_dir)
    try:
        engine_pid = debug_state(srv)["engine_pid"]
        assert srv.client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        srv.proc.send_signal(sig)
        assert srv.proc.wait(30) in (0, -sig)
        assert "shutting down" in srv.output()
        assert gone(engine_pid), f"the engine process {engine_pid} outlived the server"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        srv.log.close()


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_bench_serving_counts_every_token_with_either_client(server, http_client):
    """benchmarks.bench_serving's client against the server (the sglang /generate stream, its
    chunks three tokens each here): every request completes with its tokens counted, one arrival
    per chunk, and a failed request is counted, not raised."""
    import types

    from benchmarks.bench_serving import random_requests, run

    args = types.SimpleNamespace(
        base_url=server.url,
        backend="sglang",
        model=None,
        dataset_name="random",
        max_concurrency=4,
        seed=0,
        http_client=http_client,
    )
    requests = random_requests(8, 6, 10, 1.0, 250, seed=1)
    r = asyncio.run(run(args, requests, float("inf")))
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["output_token_throughput"] * r["duration_s"] == pytest.approx(80)
    assert r["ttft"]["median_ms"] > 0 and r["itl"]["median_ms"] > 0
    bad = asyncio.run(run(args, [([10**6], 4)], float("inf")))  # a token id past the vocabulary: HTTP 400
    assert (bad["completed"], bad["failed"]) == (0, 1) and "HTTP 400" in bad["errors"][0]
