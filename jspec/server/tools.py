"""OpenAI function calling: the grammar that forces a call, and the calls parsed out of text.

tool_choice "required" or a named function constrains the output to JSON: a named function
gives one object {"name": NAME, "arguments": {...}} whose arguments follow the function's
parameters schema; "required" gives a non-empty array of such objects, each for any declared
function. "auto" leaves the text free and parses the calls the chat template taught the model
to write: Hermes / Qwen `<tool_call>{...}</tool_call>` blocks, or Llama 3's bare JSON object
({"name": ..., "parameters": ...}, after an optional <|python_tag|>). "none" does neither.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from jspec.server.errors import APIError

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def check_tools(tools: list[dict] | None, tool_choice) -> tuple[dict[str, dict], str | None]:
    """The declared functions by name and the choice: None (no tools, or "none"), "auto",
    "required", or the name of the function that must be called."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return {}, None
    functions: dict[str, dict] = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions[f["name"]] = {**f, "parameters": params}
    if tool_choice is None or tool_choice == "auto":
        return functions, "auto"
    if tool_choice == "none":
        return functions, None
    if tool_choice == "required":
        return functions, "required"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise APIError(f"tool_choice names function {name!r}, which is not among tools", param="tool_choice")
        return functions, name
    raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")


def _call_schema(name: str, f: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": f["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(functions: dict[str, dict], choice: str) -> str:
    """The JSON schema (as text) that a forced choice constrains the output to."""
    if choice == "required":
        calls = [_call_schema(n, f) for n, f in functions.items()]
        return json.dumps({"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
    return json.dumps(_call_schema(choice, functions[choice]))


def _call(name: str, arguments: Any) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _as_call(obj, functions: dict[str, dict]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some templates teach the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(obj["name"], args) if isinstance(args, dict) else None


def parse_tool_calls(text: str, functions: dict[str, dict], choice: str | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completion's text. A forced choice's text is the grammar's
    JSON; "auto" finds the template's call syntax, and text that holds none stays content."""
    if choice is None:
        return text, []
    if choice != "auto":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short by max_tokens: the partial JSON stays content
        calls = [_as_call(d, functions) for d in (data if isinstance(data, list) else [data])]
        return (None, calls) if calls and all(calls) else (text, [])
    blocks = _HERMES_CALL.findall(text)
    if blocks:
        calls = []
        for b in blocks:
            try:
                call = _as_call(json.loads(b), functions)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed block: the client sees the text as written
            calls.append(call)
        content = _HERMES_CALL.sub("", text).strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if body.startswith("{"):
        # Llama 3 writes one object, or several separated by ";".
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _as_call(obj, functions)
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls
    return text, []
