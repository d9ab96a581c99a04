"""`jspec serve` as a user coming from SGLang starts it: a target and its EAGLE-3 head named by
Hugging Face Hub repo ids, resolved offline (HF_HUB_OFFLINE=1) from a cache under HF_HOME in
huggingface_hub's own layout (support/hub.py), with --revision (a tag),
--speculative-draft-model-revision (a commit), --tokenizer-path (another repo: the model's
has none), --chat-template (a file), --dtype, --api-key and --reasoning-parser, each seen in
what the server answers the official openai client. (--dtype float32, the dtype of the
programs test_server.py compiles: the other dtypes load in test_hub.py.)"""

import json
import os
import shutil

import pytest
from support.hub import add_snapshot
from support.models import scripted_model
from support.server import Server

import jspec
from jspec.checkpoint.tiny import make_tiny_model
from jspec.testing.eagle_tiny import make_tiny_draft

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

openai = pytest.importorskip("openai")
KEY = "sk-hub-serve"
# test_server.py's EAGLE-3 tree over a model of the same shapes: its programs are in the
# compilation cache when that module ran first.
SPEC_SHAPE = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-serve")
    cache = str(root / "hf" / "hub")  # HF_HOME/hub: huggingface_hub's default cache under HF_HOME
    scripted = scripted_model(str(root / "scripted"), max_position_embeddings=512)
    tok = root / "tok"
    tok.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(scripted, name), tok)
    # org/tiny: main is another model; the tag v1 the scripted one, without its tokenizer.
    add_snapshot(cache, "org/tiny", make_tiny_model(str(root / "other"), seed=5, max_position_embeddings=512))
    add_snapshot(cache, "org/tiny", scripted, refs=("v1",), skip=TOKENIZER_FILES)
    add_snapshot(cache, "org/tiny-tokenizer", str(tok))
    head = make_tiny_draft(str(root / "eagle3"), jspec.load(scripted).cfg, "EAGLE3", seed=4)
    head_commit = add_snapshot(cache, "org/tiny-eagle3", head)
    template = root / "concat.jinja"  # the prompt is the messages' text, nothing around it
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    s = Server(
        "org/tiny",
        *("--revision", "v1", "--tokenizer-path", "org/tiny-tokenizer", "--chat-template", str(template)),
        *("--dtype", "float32", "--api-key", KEY, "--reasoning-parser", "deepseek-r1"),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/tiny-eagle3"),
        *("--speculative-draft-model-revision", head_commit, *SPEC_SHAPE),
        log_dir=str(root),
        env={"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": None, "HUGGINGFACE_HUB_CACHE": None},
        api_key=KEY,
        name=None,
    )
    yield s
    assert s.stop()


def test_hub_ids_serve_with_every_flag_in_effect(server):
    c = server.client
    assert [m.id for m in c.models.list().data] == ["org/tiny"]  # the repo id names the model
    r = c.chat.completions.create(
        model="org/tiny", messages=[{"role": "user", "content": "hi<think>"}], max_tokens=16, temperature=0
    )
    m = r.choices[0].message
    # v1's scripted model, its reasoning split; "h", "i", "<think>": the template file and the
    # other repo's tokenizer (which has <think> as one token) made the prompt.
    assert (m.model_extra["reasoning_content"], m.content, r.usage.prompt_tokens) == ("OK", "{}", 3)
    reasoning = content = ""
    for chunk in c.chat.completions.create(
        model="org/tiny",
        messages=[{"role": "user", "content": "hi\n"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    ):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == ("OK", "{}")
    info = json.loads(server.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}"}))
    assert info["dtype"] == "float32" and info["model"] == "org/tiny"
    assert (info["speculative"]["algorithm"], info["speculative"]["num_steps"]) == ("EAGLE3", 3)


def test_the_api_key_is_asked_for(server):
    for key in ("sk-wrong", None):
        omit = {"Authorization": openai.Omit()} if key is None else {}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key or KEY, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(
                model="org/tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers=omit
            )
    assert server.get("/health") == ""
    code, body = server.post_raw("/load_lora_adapter", json.dumps({"lora_name": "a", "lora_path": "x"}).encode())
    assert code == 401 and body["error"]["code"] is None and "API key" in body["error"]["message"]
