"""PD disaggregation: a prefill engine (scripts/serve.py --disaggregation-mode prefill, its own
process) and a decode engine (this process) give one engine's greedy tokens under EAGLE-3 and
the overlap loop; a full decode engine queues arrived transfers; a prefill engine killed while
it owes KV fails those requests with an error the HTTP client sees and leaks no decode pages;
a request's state survives extraction and writing bit for bit; links fail clearly mid-message.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from support import REPO_ROOT
from support.lowering import on_h200
from support.sync_guard import count_device_reads

import jspec
from jspec.checkpoint.tiny import make_tiny_model
from jspec.config.sampling import MAX_LOGIT_BIAS_TOKENS
from jspec.disaggregation import kv_io
from jspec.disaggregation.decode import DecodeEngine
from jspec.disaggregation.prefill import PrefillEngine
from jspec.disaggregation.transfer import Link, LinkClosed, ShmLink
from jspec.testing.eagle_tiny import make_tiny_draft

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

ROOT = REPO_ROOT
SPEC_FLAGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    model = make_tiny_model(str(root / "tiny"), seed=2, max_position_embeddings=256)
    draft = make_tiny_draft(str(root / "eagle3"), jspec.load(model).cfg, "EAGLE3", seed=4)
    return model, draft


@pytest.fixture(scope="module")
def spec(dirs):
    return jspec.SpecConfig("EAGLE3", dirs[1], num_steps=3, eagle_topk=2, num_draft_tokens=5)


class PrefillProcess:
    """scripts/serve.py --disaggregation-mode prefill, page size 4 (the decode side uses 8)."""

    def __init__(self, model, draft):
        port = free_port()
        self.addr = f"127.0.0.1:{port}"
        self.log = open(os.path.join(os.path.dirname(model), f"prefill-{port}.log"), "w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "scripts", "serve.py"),
                "--model-path",
                model,
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(port),
                "--attention-backend",
                "reference",
                "--skip-warmup",
                "--page-size",
                "4",
                "--max-total-tokens",
                "2048",
                "--max-running-requests",
                "8",
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                draft,
                *SPEC_FLAGS,
                "--log-level",
                "info",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 180
        while "listening on" not in self.output():
            if self.proc.poll() is not None or time.time() > deadline:
                out = self.output()
                self.kill()
                raise RuntimeError(f"prefill engine did not come up: {out}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def prefill(dirs):
    p = PrefillProcess(*dirs)
    yield p
    p.kill()


@pytest.fixture(scope="module")
def decode(dirs, spec, prefill):
    """Two request slots, so a third request's transfer has to wait for one; room on the device for
    about two requests' arrived KV, so later ones wait on the host (both paths run). A lone row
    pads to two, as in the reference: one decode program per sampling mode, not two."""
    engine = DecodeEngine(
        dirs[0],
        speculative=spec,
        page_size=8,
        max_total_tokens=760,
        max_running_requests=2,
        precompile_bs_paddings=[2],
        attention_backend="reference",
        prefill_addrs=[prefill.addr],
        transfer_stage_bytes=60_000,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(dirs, spec):
    engine = jspec.Engine(
        dirs[0],
        speculative=spec,
        page_size=8,
        max_total_tokens=760,
        max_running_requests=2,
        precompile_bs_paddings=[2],
        attention_backend="reference",
    )
    return engine.generate


PROMPTS = ["Hello there", "jspec splits prefill from decode", "abc" * 9, "x", "The quick brown fox " * 3]


def check_same(got, ref):
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids and g.text == r.text
        assert g.spec_verify_ct == r.spec_verify_ct >= 1  # the draft state came across as well


def test_two_processes_match_one_engine(decode, reference):
    """EAGLE-3 (tree, topk 2) and the overlap loop on both sides; different page sizes. The
    second request samples with a seed and penalties: its first token is drawn by the prefill
    engine, the rest by the decode engine from the transferred penalty counts."""
    assert decode.overlap
    params = [
        jspec.SamplingParams(max_new_tokens=16),
        jspec.SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, frequency_penalty=0.5, repetition_penalty=1.3),
    ]
    got = decode.generate(PROMPTS[:2], params)
    check_same(got, reference(PROMPTS[:2], params))
    assert sorted(t.num_tokens for t in decode.scheduler.transfers) == sorted(len(o.prompt_token_ids) for o in got)
    decode.check_idle_no_leaks()


def test_full_decode_engine_queues_transfers(decode, reference):
    """Five requests, two slots: arrived KV waits on the host until a slot frees, none is dropped."""
    decode.scheduler.max_queued = 0
    with count_device_reads():  # the designated read of each step, and no other (admission included)
        got = decode.generate(PROMPTS, jspec.SamplingParams(max_new_tokens=12))
    check_same(got, reference(PROMPTS, jspec.SamplingParams(max_new_tokens=12)))
    assert decode.scheduler.max_queued >= 1
    assert {t.on_device for t in decode.scheduler.transfers} == {True, False}
    assert all(o.finish_reason == "length" for o in got)
    decode.check_idle_no_leaks()


def test_mismatched_decode_engine_is_refused(dirs, spec, prefill, tmp_path):
    """A decode engine without the prefill engine's EAGLE-3 draft, or with other weights of the
    same shapes, cannot take its requests' state."""
    from jspec.disaggregation.decode import PrefillUnavailable

    other = make_tiny_model(str(tmp_path / "other"), seed=3, max_position_embeddings=256)
    for model, sp, why in ((dirs[0], None, "different state layouts"), (other, spec, "different weights")):
        engine = DecodeEngine(
            model,
            speculative=sp,
            page_size=8,
            max_total_tokens=248,
            max_running_requests=2,
            attention_backend="reference",
            prefill_addrs=[prefill.addr],
        )
        with pytest.raises(PrefillUnavailable, match=f"refused this decode engine: .*{why}"):
            engine.generate(["hi"], jspec.SamplingParams(max_new_tokens=2))
        engine.check_idle_no_leaks()
        engine.close()


def test_killed_prefill_engine_fails_requests_and_leaks_nothing(decode, prefill, dirs):
    """Over HTTP (the decode server's app): a request admitted before the kill finishes; those the
    dead prefill engine still owed fail with 503 and a message; no decode page stays held."""
    httpx = pytest.importorskip("httpx")
    from jspec.engine.async_engine import AsyncEngine
    from jspec.server.app import create_app

    aengine = AsyncEngine(decode)
    app = create_app(aengine, "tiny")

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://decode", timeout=120) as client:

            def body(prompt, n):
                return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}

            async def until(cond, what):
                deadline = time.time() + 120
                while not cond():
                    assert time.time() < deadline, f"timed out waiting until {what}"
                    await asyncio.sleep(0.005)

            survivor = asyncio.create_task(client.post("/v1/completions", json=body("survivor", 60)))
            await until(lambda: decode.scheduler.running, "the first request decodes")
            # Prompts of a length the prefill engine has not compiled yet: it is busy with them when killed.
            doomed = [
                asyncio.create_task(client.post("/v1/completions", json=body("z" * 150 + str(i), 8))) for i in range(3)
            ]
            await until(lambda: len(decode.scheduler.awaiting) == 3, "three requests wait on the prefill engine")
            prefill.kill()
            failed = await asyncio.gather(*doomed)
            ok = await survivor
            state = (await client.get("/debug/state")).json()
            return failed, ok, state

    try:
        failed, ok, state = asyncio.run(run())
        for r in failed:
            assert r.status_code == 503, r.text
            assert "prefill engine" in r.json()["error"]["message"] and "went away" in r.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 60
        assert state["requests"] == 0 and state["kv_pages_free"] + state["kv_pages_cached"] == state["kv_pages_total"]
        assert state["request_slots_free"] == state["request_slots_total"]
    finally:
        aengine.shutdown()
    decode.check_idle_no_leaks()


def test_after_the_prefill_engine_is_gone(decode):
    """(After the kill above.) New requests fail at once, saying the engine cannot be reached."""
    from jspec.disaggregation.decode import PrefillUnavailable

    with pytest.raises(PrefillUnavailable, match="cannot reach the prefill engine"):
        decode.generate(["anyone there?", "hello?"], jspec.SamplingParams(max_new_tokens=4))
    decode.check_idle_no_leaks()


def test_request_state_round_trip_is_exact(dirs, spec):
    """A prefilled request's every state leaf (target and draft KV, carry, penalty rows and
    logit_bias) read out of a page-4 engine, written into a page-8 engine and read out again is
    unchanged."""
    src = PrefillEngine(
        dirs[0],
        speculative=spec,
        page_size=4,
        max_total_tokens=252,
        max_running_requests=2,
        attention_backend="reference",
        disable_overlap_schedule=True,
    )
    src.add_prefill("a", list(range(3, 40)), jspec.SamplingParams(repetition_penalty=1.2, logit_bias={5: 1.5}), seed=5)
    while src.has_work():
        src.step()
    (h,) = src.handoffs
    out = [np.asarray(a) for a in h.arrays]
    out = [a[:, : h.num_tokens] if i < h.num_paged else a for i, a in enumerate(out)]
    dst_engine = jspec.Engine(
        dirs[0],
        speculative=spec,
        page_size=8,
        max_total_tokens=504,
        max_running_requests=2,
        attention_backend="reference",
    )
    dst, kv = dst_engine.worker, dst_engine.scheduler.kv
    pages, slot = kv.allocator.alloc(6), kv.alloc_slot()
    staged = kv_io.stage_request(kv_io.layout(dst.state), out, h.num_tokens, to_device=True)
    dst.state = kv_io.write_request(dst.state, staged, pages, 8, h.num_tokens, slot)
    back = [np.asarray(a) for a in kv_io.extract_request(dst.state, pages, 8, h.num_tokens, slot)]
    assert len(back) == len(out) > h.num_paged >= 4  # target and draft K/V, then the slot rows
    for i, (a, b) in enumerate(zip(out, back)):
        b = b[:, : h.num_tokens] if i < h.num_paged else b
        np.testing.assert_array_equal(a, b)
        assert np.any(a != 0)  # every leaf carries something
    src.check_idle_no_leaks()


def test_serve_flags_make_a_decode_engine(dirs):
    """The server's decode-mode flags (the prefill mode runs in the fixture above)."""
    from jspec.server.args import build_parser, engine_config, load_config, server_config
    from jspec.server.launch import make_engine

    ap = build_parser()
    base = [
        "--page-size",
        "8",
        "--max-total-tokens",
        "256",
        "--attention-backend",
        "reference",
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        "shm",
    ]
    args = ap.parse_args(base + ["--disaggregation-prefill-addrs", "127.0.0.1:1", "localhost:2"])
    engine = make_engine(engine_config(args), server_config(args), load_config(args), dirs[0])
    assert isinstance(engine, DecodeEngine) and engine.router.addrs == ["127.0.0.1:1", "localhost:2"]
    assert engine.router.backend == "shm"
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        args = ap.parse_args(base + ["--disaggregation-prefill-addrs", "nohost"])
        make_engine(engine_config(args), server_config(args), load_config(args), dirs[0])


@pytest.mark.parametrize("n", [1024, 8192])
def test_transfer_steps_lower_for_cuda(n):
    """The read-out and the donated write at the Llama-3.1-8B shape with an EAGLE-3 head (bf16,
    page 16, 32 slots), lowered for an abstract H200 (docs/architecture.md, "Kernels": every step gets this test)."""
    from jspec.kvcache.pool import KVPool
    from jspec.layers.penalties import PenaltyState

    bf16, i32, sds = jax.numpy.bfloat16, np.int32, jax.ShapeDtypeStruct
    slots, pages, vocab = 33, 4096, 128256
    target = KVPool(*[sds((32, pages, 16, 8, 128), bf16)] * 2)
    draft = KVPool(*[sds((1, pages, 16, 8, 128), bf16)] * 2)
    carry = (
        sds((slots,), i32),
        sds((slots,), i32),
        (sds((slots, 1), np.float32), sds((slots, 1), i32), sds((slots, 4096), bf16)),
    )
    bias = (sds((slots, MAX_LOGIT_BIAS_TOKENS), i32), sds((slots, MAX_LOGIT_BIAS_TOKENS), np.float32))
    state = (target, draft, carry, PenaltyState(sds((slots, vocab), i32), sds((slots, vocab), bool), *bias))
    paged = [sds((a.shape[0], n, 8, 128), bf16) for a in (*target, *draft)]
    rows = [sds(a.shape[1:], a.dtype) for a in jax.tree.leaves(state[2:])]
    with on_h200():
        kv_io._extract.trace(state, sds((n,), i32), sds((), i32)).lower(lowering_platforms=("cuda",))
        w = kv_io._write.trace(state, paged, rows, sds((n,), i32), sds((), i32)).lower(lowering_platforms=("cuda",))
    assert "tf.aliasing_output" in w.as_text()  # the state is donated: updated in place


@pytest.mark.parametrize("cls", [Link, ShmLink])
def test_link_carries_arrays_and_fails_clearly_mid_message(cls):
    a, b = socket.socketpair()
    tx, rx = cls(a, "tx"), cls(b, "rx")
    tx.peer_pid = rx.peer_pid = os.getpid()
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(7, np.int32),
        np.ones((2, 3), jax.numpy.bfloat16),
        np.zeros((0, 5), np.int32),
    ]
    tx.send({"type": "kv", "rid": "r"}, arrays)
    header, got = rx.recv()
    assert header["rid"] == "r"
    for x, y in zip(arrays, got):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    if cls is ShmLink:
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"jspd_{os.getpid()}_")]
    # A frame cut short, as when the sender dies mid-transfer: the receiver says how far it got.
    whole = socket.socketpair()
    Link(whole[0], "x").send({"type": "kv", "rid": "cut"}, [np.zeros(1000, np.float32)])
    data = whole[1].recv(1 << 16)
    a.sendall(data[:-100])
    a.close()
    with pytest.raises(LinkClosed, match=r"closed the link after 3900 of 4000 bytes of a kv message for request 'cut'"):
        rx.recv()
    for s in (b, *whole):
        s.close()


def test_shm_link_hands_over_views_of_an_unlinked_file():
    """The receiver's arrays are read-only views of the sender's file (no copy), and the file's
    name is gone as soon as it is mapped; a header naming anything but a jspec transfer file
    is refused before it is opened."""
    a, b = socket.socketpair()
    tx, rx = ShmLink(a, "tx"), ShmLink(b, "rx")
    big = np.arange(1 << 20, dtype=np.float32)
    tx.send({"type": "kv", "rid": "v"}, [big, np.ones(3, np.int8)])
    _, (got, small) = rx.recv()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"jspd_{os.getpid()}_")]
    assert not got.flags.writeable and not got.flags.owndata and got.base is not None
    np.testing.assert_array_equal(got, big)
    np.testing.assert_array_equal(small, np.ones(3, np.int8))
    with pytest.raises(LinkClosed, match="is not a jspec transfer file"):
        rx._take_arrays({"shm": "../etc/passwd", "arrays": []}, None)
    for s in (a, b):
        s.close()
