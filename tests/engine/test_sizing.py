"""The KV pool and running-request rules (engine/sizing.py), as pure functions of the device's
memory, the weights and the programs' measured needs."""

import pytest

from jspec.engine.sizing import (
    CPU_RUNNING_REQUESTS,
    DEFAULT_KV_BYTES,
    HEADROOM_FRACTION,
    MAX_RUNNING_REQUESTS,
    MAX_RUNNING_REQUESTS_SPECULATIVE,
    PROGRAM_BYTES_FACTOR,
    plan_pool,
)

GiB = 2**30
# The Llama-3.1-8B shape at page 16: 32 layers x 16 tokens x 8 KV heads x 128 x (K, V) x bf16.
PAGE_8B = 32 * 16 * 8 * 128 * 2 * 2


def test_without_an_accelerator_the_cpu_defaults_hold():
    plan = plan_pool(page_size=16, bytes_per_page=PAGE_8B)
    assert plan.pages == DEFAULT_KV_BYTES // PAGE_8B
    assert plan.max_running_requests == CPU_RUNNING_REQUESTS
    assert "no accelerator" in plan.pool_source and "no accelerator" in plan.running_source


def test_an_8b_model_on_an_h200_gets_hundreds_of_thousands_of_tokens():
    device, weights, programs = int(125.8 * GiB), 15 * GiB, int(0.3 * GiB)
    plan = plan_pool(
        page_size=16, bytes_per_page=PAGE_8B, device_bytes=device, weight_bytes=weights, program_bytes=programs
    )
    headroom = device * HEADROOM_FRACTION
    free = device - weights - programs * PROGRAM_BYTES_FACTOR - headroom
    assert plan.pages == int(free // PAGE_8B)
    assert plan.tokens > 800_000
    # Everything fits: the pool, the weights, the programs' reserve, the headroom.
    assert plan.pool_bytes + weights + programs * PROGRAM_BYTES_FACTOR + headroom <= device
    assert plan.max_running_requests == MAX_RUNNING_REQUESTS
    assert "measured peak" in plan.pool_source and plan.describe()["max_total_tokens"] == plan.tokens


def test_the_programs_needs_come_out_of_the_pool():
    kw = dict(page_size=16, bytes_per_page=PAGE_8B, device_bytes=80 * GiB, weight_bytes=15 * GiB)
    small, big = plan_pool(**kw, program_bytes=GiB), plan_pool(**kw, program_bytes=9 * GiB)
    freed = 8 * GiB * PROGRAM_BYTES_FACTOR
    assert (small.pages - big.pages) * PAGE_8B == pytest.approx(freed, abs=PAGE_8B)


def test_speculation_caps_running_requests_lower():
    kw = dict(page_size=16, bytes_per_page=PAGE_8B, device_bytes=125 * GiB, weight_bytes=15 * GiB, program_bytes=0)
    assert plan_pool(**kw, speculative=True).max_running_requests == MAX_RUNNING_REQUESTS_SPECULATIVE


def test_a_small_pool_lowers_the_running_limit_to_two_pages_a_request():
    # 76 GiB of weights on an 80 GiB card: a few hundred pages of the 8B shape.
    plan = plan_pool(
        page_size=16, bytes_per_page=PAGE_8B, device_bytes=80 * GiB, weight_bytes=int(76 * GiB), program_bytes=0
    )
    assert plan.max_running_requests == (plan.pages - 1) // 2 < MAX_RUNNING_REQUESTS
    assert "two pages" in plan.running_source


def test_settings_win_over_the_device():
    kw = dict(page_size=16, bytes_per_page=PAGE_8B, device_bytes=125 * GiB, weight_bytes=15 * GiB, program_bytes=0)
    plan = plan_pool(**kw, max_total_tokens=1000, max_running_requests=7)
    assert plan.pages == -(-1000 // 16) + 1 and plan.tokens >= 1000
    assert (plan.max_running_requests, plan.running_source) == (7, "max_running_requests")
    # SGLang's meaning: the fraction covers weights + KV.
    plan = plan_pool(**kw, mem_fraction_static=0.5)
    assert plan.pages == int((125 * GiB * 0.5 - 15 * GiB) // PAGE_8B)


def test_memory_that_cannot_hold_the_model_is_a_clear_error():
    kw = dict(page_size=16, bytes_per_page=PAGE_8B, device_bytes=16 * GiB, weight_bytes=16 * GiB)
    with pytest.raises(ValueError, match="leaves no room for KV"):
        plan_pool(**kw, program_bytes=0)
    with pytest.raises(ValueError, match="leaves no room for KV"):
        plan_pool(**kw, mem_fraction_static=0.9)
    with pytest.raises(ValueError, match="programs, which need"):
        plan_pool(**dict(kw, device_bytes=40 * GiB), mem_fraction_static=0.99, program_bytes=2 * GiB)
    with pytest.raises(ValueError, match="needs an accelerator"):
        plan_pool(page_size=16, bytes_per_page=PAGE_8B, mem_fraction_static=0.5)
