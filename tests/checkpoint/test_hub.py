"""Checkpoints named by Hugging Face Hub repo ids, resolved by huggingface_hub itself from a
cache tree written in its layout (support/hub.py), offline: models at a branch, a tag or a
commit, a tokenizer from another repo, an EAGLE-3 head; ids that resolve nowhere fail naming
the id and what was tried (offline, local_files_only, an unreachable Hub); online, only the
files the readers open are fetched. Local directories load as before."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from support.hub import add_snapshot, use_cache

import jspec
from jspec.checkpoint.hub import HubCheckpointError, resolve_checkpoint
from jspec.checkpoint.tiny import make_tiny_model
from jspec.testing.eagle_tiny import make_tiny_draft

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """org/tiny: main a tiny model, tag v1 (and its commit) another of two shards; org/tok: a
    tokenizer of its own chat template; org/tiny-eagle3: an EAGLE-3 head for main."""
    root = tmp_path_factory.mktemp("hub")
    cache = str(root / "cache")
    main = make_tiny_model(str(root / "main"), seed=1, max_position_embeddings=256)
    v1 = make_tiny_model(str(root / "v1"), seed=2, max_position_embeddings=256, num_shards=2)
    tok = str(root / "tok")
    os.makedirs(tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(main, name), tok)
    with open(os.path.join(tok, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    with open(os.path.join(tok, "tokenizer_config.json"), "w") as f:
        json.dump({**tok_config, "chat_template": TEMPLATE}, f)
    draft = make_tiny_draft(str(root / "eagle3"), jspec.load(main).cfg, "EAGLE3", seed=3)
    return {
        "cache": cache,
        "dirs": {"main": main, "v1": v1, "eagle3": draft},
        "main": add_snapshot(cache, "org/tiny", main),
        "v1": add_snapshot(cache, "org/tiny", v1, refs=("v1",)),
        "tok": add_snapshot(cache, "org/tok", tok),
        "eagle3": add_snapshot(cache, "org/tiny-eagle3", draft),
        "partial": add_snapshot(cache, "org/partial", main, skip=("config.json",)),
    }


def same_params(a, b) -> bool:
    import jax

    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))


def test_hub_ids_load_at_a_branch_a_tag_or_a_commit(hub, monkeypatch):
    use_cache(monkeypatch, hub["cache"])
    main, v1 = jspec.load(hub["dirs"]["main"]), jspec.load(hub["dirs"]["v1"])
    got = jspec.load("org/tiny")
    assert same_params(got, main) and not same_params(got, v1)
    assert got.path == os.path.join(hub["cache"], "models--org--tiny", "snapshots", hub["main"])
    assert got.tokenizer.encode("hi") == main.tokenizer.encode("hi")
    assert same_params(jspec.load("org/tiny", revision="v1"), v1)
    assert same_params(jspec.load("org/tiny", revision=hub["v1"]), v1)
    # Another repo's tokenizer (its own chat template), a chat template in place of it, a dtype.
    model = jspec.load("org/tiny", tokenizer_path="org/tok", dtype="bfloat16")
    assert model.tokenizer.chat_template == TEMPLATE and model.params["embed"].dtype == jnp.bfloat16
    model = jspec.load("org/tiny", chat_template="{{ messages[0]['content'] }}!", dtype="float16")
    assert model.tokenizer.chat_template == "{{ messages[0]['content'] }}!"
    assert model.params["embed"].dtype == jnp.float16
    # A local directory is read as before, a revision aside.
    assert same_params(jspec.load(hub["dirs"]["main"], revision="v1"), main)


def test_an_eagle3_head_by_hub_id(hub, monkeypatch):
    from jspec.checkpoint.eagle import load_draft_model
    from jspec.speculative.registry import make_method

    use_cache(monkeypatch, hub["cache"])
    cfg = jspec.load(hub["dirs"]["main"]).cfg
    spec = jspec.SpecConfig("EAGLE3", "org/tiny-eagle3", draft_model_revision=hub["eagle3"], num_steps=2)
    _, params = make_method(spec, cfg, dtype=jnp.float32)
    _, expected = load_draft_model(hub["dirs"]["eagle3"], cfg, dtype=jnp.float32)
    assert same_params(jspec.Model(cfg, params), jspec.Model(cfg, expected))


def test_ids_that_resolve_nowhere_say_what_was_tried(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    use_cache(monkeypatch, hub["cache"])
    with pytest.raises(HubCheckpointError, match="HF_HUB_OFFLINE is set") as e:
        jspec.load("org/nope")
    assert "'org/nope'" in str(e.value) and hub["cache"] in str(e.value)
    with pytest.raises(HubCheckpointError, match="org/tiny.*revision v9.*not in the cache"):
        jspec.load("org/tiny", revision="v9")
    with pytest.raises(HubCheckpointError, match="has no config.json"):
        jspec.load("org/partial")
    with pytest.raises(HubCheckpointError, match="tokenizer 'org/notok'"):
        jspec.load("org/tiny", tokenizer_path="org/notok")

    use_cache(monkeypatch, hub["cache"], offline=False)
    with pytest.raises(HubCheckpointError, match="local_files_only kept the Hub out"):
        jspec.load("org/nope", local_files_only=True)
    # Online, a Hub that cannot be reached: a branch that is cached still loads, the rest fails
    # naming the Hub. (A commit hash makes huggingface_hub retry the Hub for some 20 s first.)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(HubCheckpointError, match=r"the Hub \(http://127.0.0.1:9\) could not be reached"):
        resolve_checkpoint("org/nope")
    assert resolve_checkpoint("org/tiny", revision="v1").endswith(hub["v1"])
    # Paths that are no repo id are left to the reader, as before.
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jspec.load(str(tmp_path / "nope"))


def test_online_only_the_files_the_readers_open_are_fetched(tmp_path, monkeypatch):
    """snapshot_download in place of the Hub: a repo that also holds PyTorch weights, a
    consolidated file and docs gives up its config, tokenizer, index and the shards the index
    names; a draft without safetensors its .bin; an adapter its two files."""
    import fnmatch

    import huggingface_hub

    remote = {
        "org/sharded": [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
            "pytorch_model.bin",
            "README.md",
            "original/params.json",
        ],
        "org/bin-head": ["config.json", "pytorch_model.bin", "README.md"],
        "org/adapter": ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"],
    }
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        snapshot = tmp_path / repo_id / "c0ffee"
        for name in remote[repo_id]:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snapshot / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
                (snapshot / name).write_text(json.dumps(index) if name.endswith("index.json") else "x")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    got = resolve_checkpoint("org/sharded", revision="main")
    assert sorted(os.listdir(got)) == sorted(remote["org/sharded"][:7])
    assert calls[0][1] == "main" and calls[1][1] == "c0ffee"  # the weights at the commit main resolved to
    assert sorted(os.listdir(resolve_checkpoint("org/bin-head", "draft"))) == ["config.json", "pytorch_model.bin"]
    assert sorted(os.listdir(resolve_checkpoint("org/adapter", "adapter"))) == remote["org/adapter"][:2]


def test_a_server_given_an_unknown_id_exits_naming_it(hub, monkeypatch, capsys):
    from jspec.server.launch import main

    use_cache(monkeypatch, hub["cache"])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")  # main() sets the server's share: undone after
    with pytest.raises(SystemExit) as e:
        main(["--model-path", "org/unknown-model", "--port", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'org/unknown-model' is not a local directory" in err and "HF_HUB_OFFLINE" in err
