"""SGLang's native API: /generate, and /load_lora_adapter and /unload_lora_adapter, which load
and unload adapters on the engine's loop, between steps, while requests run."""

from __future__ import annotations

import json
import time
from contextlib import aclosing

import anyio
from fastapi import APIRouter, Request

from jspec.config.sampling import SamplingParams
from jspec.engine.facts import lora_adapters
from jspec.lora.adapter import adapter_dir
from jspec.server.errors import APIError
from jspec.server.protocol import GenerateRequest, LoadLoraRequest, check_stop
from jspec.server.state import Served
from jspec.server.streaming import Choice, EventStream, collect, merged, start

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, st: Served):
    t0 = time.perf_counter()
    if (body.text is None) == (body.input_ids is None):
        raise APIError("give exactly one of text and input_ids", param="text")
    ids = st.check_prompt(body.text if body.text is not None else body.input_ids)
    sp = dict(body.sampling_params)
    asked = "max_new_tokens" in sp
    sp.setdefault("max_new_tokens", 128)
    if isinstance(sp.get("json_schema"), dict):  # SGLang takes the schema as text; an object is as clear
        sp["json_schema"] = json.dumps(sp["json_schema"])
    if sp.get("stop") is not None:
        sp["stop"] = check_stop(sp["stop"], "sampling_params.stop")
    try:
        params = SamplingParams(
            **sp,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            lora_path=body.lora_path,
        )
    except TypeError as e:
        raise APIError(f"sampling_params: {e}", param="sampling_params") from None
    except ValueError as e:
        raise APIError(str(e), param="sampling_params") from None
    if params.n != 1:
        raise APIError("/generate takes n=1; send the request n times", param="sampling_params.n")
    if asked:
        st.check_room(len(ids), params.max_new_tokens, "sampling_params.max_new_tokens")
    else:  # SGLang's default length, within the room the prompt leaves
        params.max_new_tokens = min(params.max_new_tokens, st.check_room(len(ids), None, None))
    streams = await start(st.engine, ids, params, 0)

    def meta(c: Choice) -> dict:
        m = {
            "id": body.rid or "",
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "finish_reason": {"type": c.finish_reason, "matched": c.matched_stop} if c.finish_reason else None,
        }
        if c.verify_ct:
            m["spec_verify_ct"] = c.verify_ct
            m["spec_accept_length"] = max(c.completion_tokens - 1, 0) / c.verify_ct
        if body.return_logprob:
            m["output_token_logprobs"] = [[lp, t] for lp, t in zip(c.logprobs, c.token_ids)]
            if body.top_logprobs_num:
                m["output_top_logprobs"] = [[[lp, t] for t, lp in row] for row in c.top_logprobs]
            if body.logprob_start_len >= 0:  # the prompt's, from that position (None at the first token)
                prompt = ids[body.logprob_start_len :]
                m["input_token_logprobs"] = [[lp, t] for lp, t in zip(c.input_logprobs, prompt)]
                if body.top_logprobs_num:
                    m["input_top_logprobs"] = [
                        None if row is None else [[lp, t] for t, lp in row] for row in c.input_top_logprobs
                    ]
        return m

    if not body.stream:
        c = (await collect(streams, st.metrics.observer(t0), request))[0]
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c)}

    async def events():
        # SGLang's stream repeats the whole text and ids in every chunk: both are kept here
        # already encoded, so a chunk costs its new tokens' encoding, not the whole output's.
        c, text, ids = Choice(0), "", ""
        async with aclosing(merged(streams, st.metrics.observer(t0))) as outputs:
            async for _, out in outputs:
                c.add(out)
                text += json.dumps(out.new_text, ensure_ascii=False)[1:-1]
                if out.new_token_ids:
                    ids += ("," if ids else "") + ",".join(map(str, out.new_token_ids))
                meta_json = json.dumps(meta(c), ensure_ascii=False)
                yield f'data: {{"text": "{text}", "output_ids": [{ids}], "meta_info": {meta_json}}}\n\n'
        yield "data: [DONE]\n\n"

    return EventStream(events(), streams)


def load_adapter(engine, name: str, path: str) -> dict[str, str]:
    """Loads an adapter into engine; the adapters it then holds. Run on the engine's loop (a
    module-level function: it may cross into the engine's process)."""
    engine.load_lora(name, path)
    return lora_adapters(engine)


def unload_adapter(engine, name: str) -> dict[str, str]:
    engine.unload_lora(name)
    return lora_adapters(engine)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, st: Served):
    if not body.lora_path:
        raise APIError("lora_path (the adapter's directory or Hub repo id) is required", param="lora_path")
    try:
        # A Hub repo id is fetched here, on a worker thread: the engine's loop only reads files.
        path = await anyio.to_thread.run_sync(adapter_dir, body.lora_path)
        adapters = await st.engine.call(load_adapter, body.lora_name, path)
    except ValueError as e:
        raise APIError(str(e), param="lora_path") from None
    return {"success": True, "loaded_adapters": adapters}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: LoadLoraRequest, st: Served):
    try:
        adapters = await st.engine.call(unload_adapter, body.lora_name)
    except ValueError as e:
        raise APIError(str(e), param="lora_name") from None
    return {"success": True, "loaded_adapters": adapters}
