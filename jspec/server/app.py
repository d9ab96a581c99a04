"""The HTTP API: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, SGLang's native
/generate, /health, /metrics (Prometheus) and /debug/state, on FastAPI.

The engine runs its overlap loop on its own thread (AsyncEngine); handlers only submit
requests and read their output streams, so a slow or vanished client never blocks the loop.
A client that disconnects aborts its requests at once, which frees their KV.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jspec.config.sampling import SamplingParams
from jspec.engine.async_engine import AsyncEngine
from jspec.engine.engine import RequestOutput
from jspec.engine.outputs import tokenize_prompt
from jspec.server.chat_template import render_chat
from jspec.server.metrics import ServerMetrics
from jspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    LoadLoraRequest,
    message_text,
)


class _Choice:
    """One completion (one prompt x one of n) as it streams: text, tokens, logprobs, finish."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.matched_stop = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.verify_ct = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens, self.verify_ct = out.cached_tokens, out.spec_verify_ct
        if out.finished:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop


def _openai_finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, reason)


def create_app(engine: AsyncEngine, model_name: str, lifespan=None) -> FastAPI:
    app = FastAPI(title="jspec", docs_url=None, redoc_url=None, lifespan=lifespan)
    core = engine.engine
    model = core.model
    tokenizer = model.tokenizer
    metrics = ServerMetrics(core)
    max_top = core.worker.top_n

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return JSONResponse(APIError(msg).body(), status_code=400)
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())[1:])}: {er.get('msg')}" for er in errs[:4])
        return JSONResponse(APIError(msg or "invalid request", param=loc).body(), status_code=400)

    def check_model(name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request asks for (None: the base model), named by OpenAI's `model`
        as "base:adapter" (as SGLang) or by SGLang's `lora_path` field."""
        adapter = None
        if name is not None and name != model_name:
            base, sep, rest = name.partition(":")
            if not (sep and rest and base == model_name):
                raise APIError(f"The model `{name}` does not exist; this server serves `{model_name}` (and its LoRA "
                               f"adapters as `{model_name}:ADAPTER`)", 404, param="model", code="model_not_found")
            adapter = rest
        if lora_path is not None and adapter is not None and lora_path != adapter:
            raise APIError(f"model names adapter {adapter!r} but lora_path names {lora_path!r}", param="lora_path")
        return lora_path if lora_path is not None else adapter

    def check_prompt(prompt) -> list[int]:
        try:
            return tokenize_prompt(prompt, model)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), param="prompt") from None

    async def start(ids: list[int], params: SamplingParams, base_index: int):
        """Submits params.n copies (consecutive seeds) and returns their streams, each already past its
        first output, so that a request the engine refuses fails before any response is sent."""
        streams = []
        try:
            for k, p in enumerate(params.completions()):
                agen = engine.stream(ids, p)
                first = await agen.__anext__()
                streams.append((base_index + k, agen, first))
        except (ValueError, RuntimeError) as e:
            for _, agen, _ in streams:
                await agen.aclose()
            status = getattr(e, "status", 400)  # RequestFailed: the server's fault, not the request's
            raise APIError(str(e), status, "server_error" if status >= 500 else "invalid_request_error") from None
        return streams

    async def merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) from every stream as they come; closing it aborts the unfinished ones."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index, agen, first):
            try:
                await queue.put((index, first))
                if not first.finished:
                    async for out in agen:
                        await queue.put((index, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, e))
            finally:
                await queue.put((index, done))

        tasks = [asyncio.create_task(pump(*s)) for s in streams]
        live = len(tasks)
        try:
            while live:
                index, item = await queue.get()
                if item is done:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            for _, agen, _ in streams:
                await agen.aclose()  # aborts a request still running (client gone)

    async def collect(streams, request: Request, t0: float) -> dict[int, _Choice]:
        """Runs streams to the end; aborts them if the client disconnects meanwhile."""
        choices = {i: _Choice(i) for i, _, _ in streams}

        async def consume():
            async for i, out in observed(merged(streams), t0):
                choices[i].add(out)

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                break
        try:
            await task
        except asyncio.CancelledError:
            raise APIError("client disconnected", 499) from None
        return choices

    async def observed(items, t0: float):
        """Feeds the metrics from the outputs passing through."""
        last: dict[int, float] = {}
        async for i, out in items:
            now = time.perf_counter()
            if i not in last:
                metrics.ttft.observe(now - t0)
            elif out.new_token_ids:
                per = (now - last[i]) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    metrics.itl.observe(per)
            last[i] = now
            metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                metrics.finished(out.prompt_tokens, out.completion_tokens, out.finish_reason, now - t0,
                                 out.spec_verify_ct)
            yield i, out

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def token_text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else str(t)

    def completion_logprobs(c: _Choice, n_top: int) -> dict:
        return {
            "tokens": [token_text(t) for t in c.token_ids],
            "token_logprobs": c.logprobs,
            "top_logprobs": [{token_text(t): lp for t, lp in row} for row in c.top_logprobs] if n_top else None,
            "text_offset": [],
        }

    def chat_logprobs(token_ids, logprobs, top) -> dict:
        content = []
        for j, (t, lp) in enumerate(zip(token_ids, logprobs)):
            s = token_text(t)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_text(a), "logprob": b, "bytes": list(token_text(a).encode())}
                                             for a, b in (top[j] if j < len(top) else [])]})
        return {"content": content}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ---- OpenAI: completions --------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = check_model(body.model, body.lora_path)
        t0 = time.perf_counter()
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError("prompt is empty", param="prompt")
        n_top = body.logprobs or 0
        if n_top > max_top:
            raise APIError(f"logprobs={n_top} exceeds this server's --max-top-logprobs={max_top}", param="logprobs")
        params = body.sampling_params(body.max_tokens or 16, body.logprobs is not None, n_top, adapter)
        ids = [check_prompt(p) for p in prompts]
        streams = []
        try:
            for i, p in enumerate(ids):
                streams += await start(p, params, i * body.n)
        except APIError:
            for _, agen, _ in streams:
                await agen.aclose()
            raise
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        prompt_tokens = sum(len(p) for p in ids) * body.n
        if not body.stream:
            choices = await collect(streams, request, t0)
            out = [{"index": c.index, "text": c.text, "finish_reason": _openai_finish(c.finish_reason),
                    "matched_stop": c.matched_stop,
                    "logprobs": completion_logprobs(c, n_top) if body.logprobs is not None else None}
                   for c in sorted(choices.values(), key=lambda c: c.index)]
            completion = sum(c.completion_tokens for c in choices.values())
            return {**head, "choices": out, "usage": usage(prompt_tokens, completion)}

        async def events():
            completion = {}
            async for i, out in observed(merged(streams), t0):
                completion[i] = out.completion_tokens
                choice = {"index": i, "text": out.new_text,
                          "finish_reason": _openai_finish(out.finish_reason) if out.finished else None,
                          "logprobs": None}
                if body.logprobs is not None and out.new_token_ids:
                    c = _Choice(i)
                    c.add(out)
                    choice["logprobs"] = completion_logprobs(c, n_top)
                if out.new_text or out.finished or choice["logprobs"]:
                    yield sse({**head, "choices": [choice]})
            total = sum(completion.values())
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, total)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- OpenAI: chat completions ---------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        adapter = check_model(body.model, body.lora_path)
        t0 = time.perf_counter()
        n_top = body.top_logprobs or 0
        if n_top > max_top:
            raise APIError(f"top_logprobs={n_top} exceeds this server's --max-top-logprobs={max_top}",
                           param="top_logprobs")
        text = render_chat(tokenizer, [{**m.model_dump(exclude_none=True), "content": message_text(m)}
                                       for m in body.messages])
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = check_prompt(ids)
        max_new = body.max_completion_tokens or body.max_tokens or max(1, model.cfg.max_position_embeddings - len(ids))
        params = body.sampling_params(max_new, body.logprobs, n_top, adapter)
        streams = await start(ids, params, 0)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        prompt_tokens = len(ids) * body.n
        if not body.stream:
            choices = await collect(streams, request, t0)
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": _openai_finish(c.finish_reason), "matched_stop": c.matched_stop,
                    "logprobs": chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs) if body.logprobs else None}
                   for c in sorted(choices.values(), key=lambda c: c.index)]
            completion = sum(c.completion_tokens for c in choices.values())
            return {**head, "object": "chat.completion", "choices": out, "usage": usage(prompt_tokens, completion)}

        async def events():
            chunk = {**head, "object": "chat.completion.chunk"}
            completion, started = {}, set()
            async for i, out in observed(merged(streams), t0):
                completion[i] = out.completion_tokens
                if i not in started:
                    started.add(i)
                    yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None, "logprobs": None}]})
                lp = (chat_logprobs(out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs or [])
                      if body.logprobs and out.new_token_ids else None)
                if out.new_text or out.finished or lp:
                    yield sse({**chunk, "choices": [{
                        "index": i, "delta": {"content": out.new_text} if out.new_text else {},
                        "finish_reason": _openai_finish(out.finish_reason) if out.finished else None, "logprobs": lp}]})
            total = sum(completion.values())
            yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, total)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- SGLang native ----------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        t0 = time.perf_counter()
        if (body.text is None) == (body.input_ids is None):
            raise APIError("give exactly one of text and input_ids", param="text")
        ids = check_prompt(body.text if body.text is not None else body.input_ids)
        sp = dict(body.sampling_params)
        sp.setdefault("max_new_tokens", 128)
        try:
            params = SamplingParams(**sp, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                                    logprob_start_len=body.logprob_start_len, lora_path=body.lora_path)
        except TypeError as e:
            raise APIError(f"sampling_params: {e}", param="sampling_params") from None
        except ValueError as e:
            raise APIError(str(e), param="sampling_params") from None
        if params.n != 1:
            raise APIError("/generate takes n=1; send the request n times", param="sampling_params.n")
        streams = await start(ids, params, 0)

        def meta(c: _Choice) -> dict:
            m = {"id": body.rid or "", "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "cached_tokens": c.cached_tokens,
                 "finish_reason": {"type": c.finish_reason, "matched": c.matched_stop} if c.finish_reason else None}
            if c.verify_ct:
                m["spec_verify_ct"] = c.verify_ct
                m["spec_accept_length"] = max(c.completion_tokens - 1, 0) / c.verify_ct
            if body.return_logprob:
                m["output_token_logprobs"] = [[lp, t] for lp, t in zip(c.logprobs, c.token_ids)]
            return m

        if not body.stream:
            c = (await collect(streams, request, t0))[0]
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c)}

        async def events():
            c = _Choice(0)
            async for _, out in observed(merged(streams), t0):
                c.add(out)
                yield sse({"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- the rest -------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        adapters = sorted(core.lora.slots) if core.lora is not None else []
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "jspec", "root": model_name,
             "max_model_len": model.cfg.max_position_embeddings, "vocab_size": model.cfg.vocab_size}
            for name in [model_name] + [f"{model_name}:{a}" for a in adapters]]}

    # ---- LoRA adapters (SGLang's endpoints), loaded and unloaded on the engine thread -------------

    def loaded_adapters() -> dict:
        return {n: a.path for n, a in core.lora.adapters.items()} if core.lora is not None else {}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest):
        if not body.lora_path:
            raise APIError("lora_path (the adapter's directory) is required", param="lora_path")
        try:
            await engine.call(lambda e: e.load_lora(body.lora_name, body.lora_path))
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        return {"success": True, "loaded_adapters": loaded_adapters()}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: LoadLoraRequest):
        try:
            await engine.call(lambda e: e.unload_lora(body.lora_name))
        except ValueError as e:
            raise APIError(str(e), param="lora_name") from None
        return {"success": True, "loaded_adapters": loaded_adapters()}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(APIError("the engine loop stopped", 503, "server_error").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_server_info")
    async def server_info():
        """What serves (SGLang's endpoint): device, jax version and engine settings, so a
        benchmark client can record what it measured."""
        import dataclasses

        import jax

        spec = core.spec
        return {"model": model_name, "device_kind": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
                "jax_version": jax.__version__, "dtype": str(core.worker.dtype),
                "context_length": model.cfg.max_position_embeddings, "page_size": core.worker.page_size,
                "max_running_requests": core.config.max_running_requests, "overlap_schedule": core.overlap,
                "speculative": dataclasses.asdict(spec) if spec is not None else None}

    @app.get("/debug/state")
    async def debug_state():
        """KV and request bookkeeping, for leak checks: at idle every page is free or cached."""
        sched = core.scheduler
        return {"requests": len(sched.requests), "running": len(sched.running) + len(sched.prefilling),
                "waiting": len(sched.waiting), **sched.usage()}

    return app
