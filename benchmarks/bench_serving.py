"""Serving benchmark against a running jspec (or any OpenAI-compatible) server, in the spirit of
sglang.bench_serving: requests arrive as a Poisson process at --request-rate (inf: all at
once), at most --max-concurrency in flight, each streamed from /v1/completions.

Reports request and token throughput, TTFT, inter-token latency and end-to-end latency
(mean, median, p99), and the mean speculative accept length (from the server's /metrics),
as a table and as JSON (--output-file).

    python scripts/serve.py --port 30000 &
    python -m benchmarks.bench_serving --port 30000 --num-prompts 200 --request-rate 4
    python -m benchmarks.bench_serving --dataset-name sharegpt --dataset-path ShareGPT.json --request-rate inf

Datasets: random (token ids, --random-input-len / --random-output-len, lengths drawn from
[range_ratio x len, len]) or sharegpt (a JSON list of {"conversations": [{"value": ...}, ...]};
the first turn is the prompt, the second's length in words sets max_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time

import numpy as np

from benchmarks.common import Results, git_commit


def random_requests(n, input_len, output_len, range_ratio, vocab, seed):
    rng = np.random.default_rng(seed)
    lo_in, lo_out = max(1, int(input_len * range_ratio)), max(1, int(output_len * range_ratio))
    return [
        (
            list(map(int, rng.integers(10, vocab, rng.integers(lo_in, input_len + 1)))),
            int(rng.integers(lo_out, output_len + 1)),
        )
        for _ in range(n)
    ]


def sharegpt_requests(path, n, seed, max_output):
    with open(path) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    if not convs:
        raise SystemExit(f"{path}: no conversations with two turns")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(convs), size=min(n, len(convs)), replace=False)
    return [(convs[i][0]["value"], min(max_output, max(4, len(convs[i][1]["value"].split())))) for i in picks]


async def one_request(client, url, backend, model, prompt, max_tokens, ignore_eos):
    """Streams one request; a token arrival is a chunk that adds tokens: with the "sglang" backend
    (/generate), a chunk whose output_ids grew, so it times models served without a tokenizer
    (--load-format dummy shapes) too; with "openai" (/v1/completions), a chunk with text."""
    if backend == "sglang":
        key = "input_ids" if isinstance(prompt, list) else "text"
        path, body = (
            "/generate",
            {
                key: prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos},
            },
        )
    else:
        path, body = (
            "/v1/completions",
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos,
            },
        )
    t0 = time.perf_counter()
    times, tokens, error = [], 0, None
    try:
        async for line in client.lines(url + path, body):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if backend == "sglang":
                    if len(chunk["output_ids"]) > tokens:
                        times.append(time.perf_counter())
                        tokens = len(chunk["output_ids"])
                    continue
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except HTTPStatusError as e:
        return dict(ok=False, error=str(e))
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error or not times:
        return dict(ok=False, error=error or "no tokens")
    itl = [(b - a) for a, b in itertools.pairwise(times)]
    return dict(ok=True, ttft=times[0] - t0, e2e=end - t0, itl=itl, output_tokens=tokens)


def accept_length(url):
    """(sum, count) of the server's speculative accept-length histogram, or None."""
    import urllib.request

    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except Exception:  # noqa: BLE001 - not a jspec server
        return None
    vals = {}
    for line in text.splitlines():
        for key in ("jspec_spec_accept_length_sum", "jspec_spec_accept_length_count"):
            if line.startswith(key + " "):
                vals[key] = float(line.split()[1])
    return (vals.get("jspec_spec_accept_length_sum", 0.0), vals.get("jspec_spec_accept_length_count", 0.0))


class HTTPStatusError(Exception):
    """A response that was not 200: its status and the start of its body."""


class AiohttpLines:
    """POSTs JSON and yields the response's lines (bytes, without line ends) through aiohttp,
    the client sglang.bench_serving uses: at a few hundred streams its per-chunk cost is a
    fraction of httpx's, whose line iterator would otherwise set the pace of a fast server."""

    def __init__(self):
        import aiohttp

        # A pooled connection must expire before uvicorn closes it (5 s idle): at equal timeouts
        # a request can go out on a socket the server is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        # A line may be up to twice the read buffer: /generate's chunks repeat every output id so
        # far, past the default's 128 KiB for outputs of ~10k tokens.
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), read_bufsize=2**22
        )

    async def lines(self, url, body):
        async with self.session.post(url, json=body) as r:
            if r.status != 200:
                raise HTTPStatusError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
            async for line in r.content:
                yield line.rstrip(b"\r\n")

    async def close(self):
        await self.session.close()


class HttpxLines:
    """AiohttpLines through httpx, where aiohttp is not installed."""

    def __init__(self):
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(limits=limits, timeout=None)

    async def lines(self, url, body):
        async with self.client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raise HTTPStatusError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                yield line.encode()

    async def close(self):
        await self.client.aclose()


def http_client(name: str = "auto"):
    """The streaming client: "aiohttp", "httpx", or "auto" (aiohttp where it is installed)."""
    if name == "auto":
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            name = "httpx"
        else:
            name = "aiohttp"
    return AiohttpLines() if name == "aiohttp" else HttpxLines()


async def run(args, requests, rate):
    url = args.base_url or f"http://{args.host}:{args.port}"
    before = accept_length(url)
    sem = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = np.random.default_rng(args.seed + 1)
    client = http_client(getattr(args, "http_client", "auto"))
    try:

        async def guarded(prompt, max_tokens):
            async with sem:
                return await one_request(
                    client, url, args.backend, args.model, prompt, max_tokens, args.dataset_name == "random"
                )

        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(guarded(prompt, max_tokens)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    after = accept_length(url)
    ok = [r for r in results if r["ok"]]
    acc = None
    if before and after and after[1] > before[1]:
        acc = (after[0] - before[0]) / (after[1] - before[1])

    def stats(xs):
        xs = np.asarray(xs, float) * 1e3
        return (
            dict(mean_ms=float(xs.mean()), median_ms=float(np.median(xs)), p99_ms=float(np.percentile(xs, 99)))
            if len(xs)
            else dict(mean_ms=None, median_ms=None, p99_ms=None)
        )

    out_tokens = sum(r["output_tokens"] for r in ok)
    return dict(
        request_rate=rate,
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=sorted({r["error"] for r in results if not r["ok"]})[:5],
        duration_s=wall,
        request_throughput=len(ok) / wall,
        output_token_throughput=out_tokens / wall,
        ttft=stats([r["ttft"] for r in ok]),
        itl=stats([x for r in ok for x in r["itl"]]),
        e2e=stats([r["e2e"] for r in ok]),
        mean_accept_length=acc,
    )


def server_info(url: str) -> dict | None:
    """The server's device, jax version and settings (jspec's and SGLang's /get_server_info)."""
    import urllib.request

    try:
        return json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())
    except Exception:  # noqa: BLE001 - a server without the endpoint
        return None


def write_results(args, url: str, rows: list[dict]) -> None:
    """Appends rows to --output-file's list (several runs, e.g. spec on and off, share one file)."""
    info = server_info(url)
    commit = git_commit()
    rows = [dict(r, commit=commit, server=info) for r in rows]
    existing = []
    if os.path.exists(args.output_file):
        with open(args.output_file) as f:
            existing = json.load(f).get("rows", [])
    out, file_name = os.path.split(args.output_file)
    settings = {
        "url": url,
        "model": args.model,
        "dataset": args.dataset_name,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "max_concurrency": args.max_concurrency,
    }
    # The figures are the server's: its device and jax version, not this client's.
    Results(out, "bench_serving", settings, file_name=file_name, server=info or {}).write(rows=existing + rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--backend",
        choices=["sglang", "openai"],
        default="sglang",
        help="sglang: the native /generate stream (token ids; as sglang.bench_serving's default); "
        "openai: /v1/completions",
    )
    ap.add_argument("--base-url")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    ap.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    ap.add_argument("--dataset-path")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=1.0)
    ap.add_argument("--random-vocab-size", type=int, help="token ids drawn below this (default: the server's vocab)")
    ap.add_argument("--sharegpt-max-output", type=int, default=512)
    ap.add_argument("--request-rate", default="inf", help="requests/s, or a comma list (e.g. 1,4,16,inf)")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument(
        "--http-client", choices=["auto", "aiohttp", "httpx"], default="auto", help="auto: aiohttp where installed"
    )
    ap.add_argument("--warmup-requests", type=int, default=0, help="sent (at once) and not measured, first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-file", help="write the results as JSON here")
    ap.add_argument("--tag", default="", help="a label stored with the results (e.g. 'eagle3 8b')")
    args = ap.parse_args()
    url = args.base_url or f"http://{args.host}:{args.port}"
    import urllib.request

    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())
    args.model = args.model or models["data"][0]["id"]
    vocab = args.random_vocab_size or models["data"][0].get("vocab_size", 32000)
    if args.dataset_name == "random":
        requests = random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab, args.seed
        )
    else:
        if not args.dataset_path:
            ap.error("--dataset-name sharegpt needs --dataset-path")
        requests = sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, args.sharegpt_max_output)
    if args.warmup_requests:  # compiles the shapes the measured runs meet; not reported
        asyncio.run(run(args, requests[: args.warmup_requests], float("inf")))
    rows = []
    for rate in [float(r) for r in args.request_rate.split(",")]:
        row = asyncio.run(run(args, requests, rate))
        row["tag"] = args.tag
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.output_file:  # after every rate, so a run cut short still leaves its rows
            write_results(args, url, rows[-1:])
    print(
        f"\n{'tag':>12} {'rate':>5} {'ok':>4} {'req/s':>6} {'tok/s':>8} {'TTFT p50':>8} {'TTFT p99':>8} "
        f"{'ITL p50':>7} {'ITL p99':>7} {'E2E p50':>8} {'accept':>6}"
    )

    def f(d, k):
        return f"{d[k]:.1f}" if d[k] is not None else "-"

    for r in rows:
        acc = f"{r['mean_accept_length']:.2f}" if r["mean_accept_length"] else "-"
        print(
            f"{r['tag']:>12} {r['request_rate']:>5} {r['completed']:>4} {r['request_throughput']:>6.2f} "
            f"{r['output_token_throughput']:>8.0f} {f(r['ttft'], 'median_ms'):>8} {f(r['ttft'], 'p99_ms'):>8} "
            f"{f(r['itl'], 'median_ms'):>7} {f(r['itl'], 'p99_ms'):>7} {f(r['e2e'], 'median_ms'):>8} {acc:>6}"
        )


if __name__ == "__main__":
    sys.exit(main())
