"""`jspec serve`'s flags: grouped in --help as SGLang's docs group them, every field of every
config in one group; the flags for Hub ids, dtype, tokenizer, chat template, API key and
reasoning parser build the configs, and bad values are refused by name."""

import re

import pytest

from jspec.config.engine import EngineConfig
from jspec.config.fields import GROUPS
from jspec.config.load import LoadConfig
from jspec.config.spec import SpecConfig
from jspec.server.args import ServerConfig, build_parser, engine_config, load_config, server_config


def test_help_groups_the_flags_as_sglangs_docs_do():
    text = build_parser(prog="jspec serve").format_help()
    titles = [text.index(f"\n{title}:\n") for title in GROUPS.values()]
    assert titles == sorted(titles)  # every group, in GROUPS order
    sections = {title: text[start:end] for title, start, end in zip(GROUPS, titles, titles[1:] + [len(text)])}
    for group, flags in {
        "model": ["--model-path", "--revision", "--dtype", "--tokenizer-path", "--chat-template", "--context-length"],
        "serving": ["--host", "--port", "--api-key", "--reasoning-parser", "--served-model-name"],
        "memory": ["--page-size", "--max-total-tokens", "--chunked-prefill-size"],
        "speculative": ["--speculative-algorithm", "--speculative-draft-model-revision"],
        "parallel": ["--tp-size", "--enable-dp-attention", "--nnodes"],
        "lora": ["--lora-paths", "--max-lora-rank"],
        "disaggregation": ["--disaggregation-mode"],
    }.items():
        assert all(re.search(f"\n  {flag}[ \n]", sections[group]) for flag in flags), group
    for cls in (ServerConfig, LoadConfig, EngineConfig, SpecConfig):
        for f in cls.__dataclass_fields__.values():
            assert f.metadata["group"] in GROUPS, (cls.__name__, f.name)
    generate = build_parser(prog="jspec generate", server=False).format_help()
    assert "PD disaggregation:" not in generate and "--api-key" not in generate and "--dtype" in generate


def test_the_new_flags_build_the_configs():
    args = build_parser().parse_args(
        [
            "--model-path",
            "org/model",
            "--revision",
            "v2",
            "--dtype",
            "bfloat16",
            "--tokenizer-path",
            "org/tok",
            "--chat-template",
            "{{ messages }}",
            "--api-key",
            "sk-1",
            "--reasoning-parser",
            "qwen3",
            "--lora-paths",
            "a=org/adapter",
            "org/other-adapter",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "org/head",
            "--speculative-draft-model-revision",
            "abc",
        ]
    )
    assert load_config(args) == LoadConfig(
        revision="v2", dtype="bfloat16", tokenizer_path="org/tok", chat_template="{{ messages }}"
    )
    server = server_config(args)
    assert (server.model_path, server.api_key, server.reasoning_parser) == ("org/model", "sk-1", "qwen3")
    config = engine_config(args)
    assert config.lora_paths == {"a": "org/adapter", "other-adapter": "org/other-adapter"}
    assert (config.speculative.draft_model_path, config.speculative.draft_model_revision) == ("org/head", "abc")
    # NEXTN drafts from the target's own checkpoint, at its revision.
    args = build_parser().parse_args(["--model-path", "org/v3", "--revision", "r1", "--speculative-algorithm", "NEXTN"])
    assert engine_config(args).speculative.draft_model_revision == "r1"


def test_bad_values_are_refused_by_name(capsys):
    for flags, words in (
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--reasoning-parser", "r2"], "invalid choice: 'r2'"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(flags)
        assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        server_config(build_parser().parse_args(["--api-key", ""]))
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        LoadConfig(dtype="half")
