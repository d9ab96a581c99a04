"""DP attention on 8 CPU devices (conftest forces them), and the multi-host flags.

- dp ranks of tp / dp devices (dp = tp: one device per rank, as SGLang's common setting,
  and tp 4 / dp 2: attention tensor-parallel inside each rank) give one device's greedy
  tokens with EAGLE-3 and the overlap loop on, for a dense tiny Llama and a tiny MoE;
- a rank with no requests runs idle batches while another prefills or decodes, and
  nothing changes (tokens, no hang, no hidden host read, no leak);
- bad combinations of flags are refused; --nnodes 1 does nothing, and two local
  processes join one jax.distributed runtime through init_distributed.
"""

import os
import socket
import subprocess
import sys

import jax
import pytest
from support.models import PROMPTS, SPEC, eagle_draft, tiny_model
from support.sync_guard import count_device_reads

import jspec
from jspec.distributed.dp_attention import make_dp_mesh, shard_params_dp
from jspec.distributed.multihost import check_multihost_args, init_distributed
from jspec.engine.facts import serving_facts

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # As test_tensor_parallel: 8 query heads, 2 KV heads (so ranks of 2 devices split them),
    # and a Qwen3-MoE of 8 experts, 2 per token.
    dense = tiny_model(tmp_path_factory, "dp", seed=11, num_heads=8, num_kv_heads=2, context=256)
    moe = tiny_model(
        tmp_path_factory,
        "dp_moe",
        arch="qwen3_moe",
        seed=12,
        num_heads=8,
        num_kv_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    return {"dense": (dense, eagle_draft(dense, seed=5)), "moe": (moe, eagle_draft(moe, seed=5))}


def make_engine(model, draft, **kw):
    return jspec.Engine(
        model,
        speculative=SPEC,
        draft=draft,
        page_size=4,
        max_total_tokens=508,
        max_running_requests=4,
        precompile_bs_paddings=[4],  # one decode program per rank count, however the rows finish
        attention_backend="reference",
        max_top_logprobs=2,
        **kw,
    )


def run(engine, prompts=PROMPTS, n=10):
    outs = engine.generate(prompts, jspec.SamplingParams(max_new_tokens=n, ignore_eos=True))
    engine.check_idle_no_leaks()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def dense_one_device(models):
    return make_engine(*models["dense"])


@pytest.fixture(scope="module")
def one_device(models, dense_one_device):
    return {"dense": run(dense_one_device), "moe": run(make_engine(*models["moe"]))}


@pytest.fixture(scope="module")
def dense_dp2(models):
    m, d = models["dense"]
    return make_engine(m, d, tp_size=2, dp_size=2, enable_dp_attention=True)


@pytest.mark.parametrize(
    "name,tp,dp", [("dense", 2, 2), ("dense", 4, 4), ("dense", 4, 2), ("moe", 2, 2), ("moe", 4, 4)]
)
def test_dp_attention_greedy_equals_one_device_with_eagle3_and_overlap(models, one_device, dense_dp2, name, tp, dp):
    m, d = models[name]
    if (name, tp, dp) == ("dense", 2, 2):
        engine = dense_dp2
    else:
        engine = make_engine(m, d, tp_size=tp, dp_size=dp, enable_dp_attention=True, ep_size=tp if name == "moe" else 1)
    assert engine.overlap
    got = run(engine)
    assert got == one_device[name]
    kv = engine.worker.state.target_kv.k  # [dp, L, pages, page_size, Hkv, D]
    assert kv.shape[0] == dp and kv.sharding.spec[0] == "data" and len(kv.sharding.device_set) == tp
    shard = kv.addressable_shards[0].data
    assert shard.shape[0] == 1 and shard.shape[4] == max(2, tp // dp) // (tp // dp)  # one rank, its heads
    if name == "moe":
        experts = engine.worker.inner.params["layers"]["experts_gate_up"]  # [L, E, in, out]
        assert experts.addressable_shards[0].data.shape[1] == 8 // tp  # experts over every device, not per rank


def test_round_robin_and_shortest_queue_placement(dense_dp2):
    sched = dense_dp2.scheduler
    rids = [dense_dp2.add_request([1, 2, 3], jspec.SamplingParams(max_new_tokens=2)) for _ in range(3)]
    ranks = [sched.rank_of(r) for r in rids]
    assert sorted(ranks[:2]) == [0, 1] and ranks[2] == ranks[0]  # round robin
    sched.load_balance_method = "shortest_queue"
    try:
        extra = dense_dp2.add_request([4, 5], jspec.SamplingParams(max_new_tokens=2))
        assert sched.rank_of(extra) == ranks[1]  # the rank with one request, not two
    finally:
        sched.load_balance_method = "round_robin"
    for rid in rids + [extra]:
        assert dense_dp2.abort(rid)
    dense_dp2.check_idle_no_leaks()
    # A request lives on one rank: its room is a rank's pool's (or the context), as a server reads it.
    room = sched.ranks[0].max_request_tokens
    assert sched.max_request_tokens == room
    assert serving_facts(dense_dp2).max_request_tokens == min(room, dense_dp2.model.cfg.max_position_embeddings)


def test_idle_rank_changes_nothing(dense_dp2, one_device):
    """One request: the other rank idles in every iteration. Then staggered lengths and a late
    arrival: a rank idles while the other decodes, and while the other prefills."""
    engine, ref = dense_dp2, one_device["dense"]
    launched = []
    launch = engine.worker.launch

    def spy(batch):
        launched.append((batch.is_prefill, [b is None for b in batch.per_rank]))
        return launch(batch)

    engine.worker.launch = spy
    try:
        with count_device_reads() as reads:  # no hidden host read in the DP loop either
            assert run(engine, PROMPTS[1:2]) == ref[1:2]
        assert launched and all(sum(idle) == 1 for _, idle in launched)
        assert not reads.hidden and reads.designated

        launched.clear()
        params = [jspec.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 10)]
        rids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
        assert engine.scheduler.rank_of(rids[0]) != engine.scheduler.rank_of(rids[1])
        outs = {}
        for _ in range(3):
            for o in engine.step():
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
        late = engine.add_request(PROMPTS[3], jspec.SamplingParams(max_new_tokens=10, ignore_eos=True))
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
        assert [outs[r] for r in rids + [late]] == [ref[0][:3], ref[1], ref[3]]
        # Both ranks prefilled together at first; later one rank idled while the other decoded
        # (the short request was done) and while the other prefilled (the late one).
        assert launched[0] == (True, [False, False])
        assert (False, [True, False]) in launched or (False, [False, True]) in launched
        assert (True, [True, False]) in launched or (True, [False, True]) in launched
        engine.check_idle_no_leaks()
    finally:
        engine.worker.launch = launch


def test_bad_dp_flags_are_refused(models):
    m, _ = models["dense"]
    kw = dict(max_total_tokens=240, attention_backend="reference")
    with pytest.raises(ValueError, match="needs enable_dp_attention"):
        jspec.Engine(m, tp_size=2, dp_size=2, **kw)
    with pytest.raises(ValueError, match="needs dp_size > 1"):
        jspec.Engine(m, tp_size=2, enable_dp_attention=True, **kw)
    with pytest.raises(ValueError, match="tp_size % dp_size"):
        jspec.Engine(m, tp_size=2, dp_size=4, enable_dp_attention=True, **kw)
    with pytest.raises(ValueError, match="load_balance_method"):
        jspec.Engine(m, tp_size=2, dp_size=2, enable_dp_attention=True, load_balance_method="random", **kw)
    with pytest.raises(ValueError, match="needs that many devices"):
        make_dp_mesh(len(jax.devices()) * 2, 2)
    import dataclasses

    with pytest.raises(ValueError, match="num_attention_heads"):  # 6 heads over ranks of 4 devices
        shard_params_dp(dataclasses.replace(m.cfg, num_heads=6), m.params, make_dp_mesh(8, 2))


def test_serve_flags(tmp_path, monkeypatch):
    from jspec.checkpoint.tiny import make_tiny_model
    from jspec.server.args import build_parser, engine_config, load_config, server_config
    from jspec.server.launch import make_engine

    path = make_tiny_model(str(tmp_path / "m"), seed=11, num_heads=8, num_kv_heads=2, max_position_embeddings=256)

    args = build_parser().parse_args(
        [
            "--tp-size",
            "4",
            "--dp-size",
            "2",
            "--enable-dp-attention",
            "--load-balance-method",
            "shortest_queue",
            "--max-total-tokens",
            "400",
            "--page-size",
            "4",
            "--attention-backend",
            "reference",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "10.0.0.1:5000",
        ]
    )
    assert (args.dp_size, args.enable_dp_attention, args.nnodes, args.node_rank) == (2, True, 2, 1)
    engine = make_engine(engine_config(args), server_config(args), load_config(args), path)
    assert engine.worker.dp == 2 and engine.scheduler.load_balance_method == "shortest_queue"
    assert [r.kv.allocator.num_usable for r in engine.scheduler.ranks] == [100, 100]  # --max-total-tokens per rank
    for bad, match in [
        ((2, 2, "h:1"), "node-rank"),
        ((2, 0, None), "needs --dist-init-addr"),
        ((2, 0, "nohost"), "HOST:PORT"),
        ((2, 0, "h:99999"), "HOST:PORT"),
        ((0, 0, None), "nnodes"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_multihost_args(*bad)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert init_distributed(1, 0, None) is False and not calls  # one node: nothing to join
    assert init_distributed(2, 1, "10.0.0.1:5000") is True
    assert calls == [dict(coordinator_address="10.0.0.1:5000", num_processes=2, process_id=1)]


CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from jspec.distributed.multihost import init_distributed
init_distributed(2, int(sys.argv[1]), sys.argv[2])
import jax
print(jax.process_index(), jax.process_count(), len(jax.devices()), len(jax.local_devices()))
jax.distributed.shutdown()
"""


def test_two_local_processes_join_one_runtime():
    """What one machine can check of multi-host: two processes, one coordinator, every
    process sees both processes' devices (real multi-host serving is not tested)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(r), addr],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert sorted(o.split() for o, _ in outs) == [["0", "2", "4", "2"], ["1", "2", "4", "2"]]


def test_sampling_logprobs_and_penalties_per_rank(dense_one_device, dense_dp2):
    """Seeded sampling, penalties and logprobs live in each rank's own slots: the same as on one device."""
    sp = jspec.SamplingParams(
        max_new_tokens=6,
        temperature=0.8,
        top_k=20,
        seed=3,
        return_logprob=True,
        top_logprobs_num=2,
        frequency_penalty=0.3,
    )
    one, dp = (e.generate(PROMPTS, sp) for e in (dense_one_device, dense_dp2))
    assert [o.token_ids for o in one] == [o.token_ids for o in dp]
    for a, b in zip(one, dp):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
    dense_dp2.check_idle_no_leaks()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_dp_speculative_decode_step_lowers_for_cuda(models, name, monkeypatch):
    """The one-dispatch EAGLE-3 iteration over 2 ranks of 2 abstract H200s, kernels compiled
    (not interpreted): the shard_map over ranks, the Triton attention kernels inside it and
    the MLP's collectives all lower for CUDA."""
    import functools

    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, use_abstract_mesh
    from jax.sharding import PartitionSpec as P
    from support.lowering import H200

    import jspec.kernels.backend
    from jspec.distributed.dp_attention import RankStep
    from jspec.distributed.mesh import DATA
    from jspec.layers.sampling import NUM_PARAMS, SamplingRows

    m, d = models[name]
    w = make_engine(m, d, tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=4 if name == "moe" else 1).worker
    mesh = AbstractMesh((2, 2), (DATA, "tensor"), axis_types=(AxisType.Auto,) * 2, abstract_device=H200)

    def like(x):  # the same array on the abstract mesh
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))

    def ranked(*shape, dt=jnp.int32):  # a per-rank input
        return jax.ShapeDtypeStruct((2, *shape), dt, sharding=NamedSharding(mesh, P(DATA)))

    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)
    step = RankStep(w._decode.step, mesh, w._decode.shared)
    B, M = 4, 32
    with use_abstract_mesh(mesh):
        fn = jax.jit(
            functools.partial(
                step._run, cfg=w.inner.cfg, method=w.inner.method, backend="pallas", top_n=0, sampling="greedy"
            )
        )
        text = (
            fn.trace(
                jax.tree.map(like, w.inner.params),
                jax.tree.map(like, w.inner.dparams),
                jax.tree.map(like, w.state),
                ranked(B),
                ranked(B, M),
                SamplingRows(ranked(B, NUM_PARAMS, dt=jnp.float32), ranked(B, dt=jnp.uint32)),
                None,
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert "__gpu$xla.gpu.triton" in text
    if name == "dense":
        assert "all_gather" in text and "reduce_scatter" in text
    else:
        assert "all_to_all" in text
