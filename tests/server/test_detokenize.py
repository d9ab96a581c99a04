"""Incremental detokenization and stop conditions (jspec/scheduler/detokenize.py)."""

from __future__ import annotations

import random

import pytest

from jspec.checkpoint.tiny import BOS_ID, EOS_IDS, build_byte_tokenizer
from jspec.checkpoint.tokenizer import Tokenizer
from jspec.scheduler.detokenize import FinishReason, IncrementalDetokenizer, StopChecker

EOT = EOS_IDS[1]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """The tiny models' byte-level tokenizer: id b < 256 is byte b."""
    path = tmp_path_factory.mktemp("byte_tok")
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return Tokenizer(path)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style vocabulary: "\u2581" is a space, dropped at the start of a decode."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581a": 4, "b": 5}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    path = tmp_path_factory.mktemp("sp_tok")
    t.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def ids_of(data: bytes) -> list[int]:
    return list(data)


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(c) for c in chunks] + [detok.flush()]


def split(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


# ---------------------------------------------------------------- detokenizer

TEXT = "héllo 世界 😀👍🏽 ok Ж\n"


def test_every_split_point_of_multibyte_text(tok):
    data = TEXT.encode()
    ids = ids_of(data)
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        pieces = stream(detok, [ids[:cut], ids[cut:]])
        assert "".join(pieces) == TEXT
        assert all("\ufffd" not in p for p in pieces), (cut, pieces)


def test_byte_by_byte_emits_each_character_once_complete(tok):
    detok = IncrementalDetokenizer(tok)
    data = TEXT.encode()
    emitted = ""
    for i, b in enumerate(data):
        emitted += detok.add([b])
        try:
            # When the bytes so far are complete UTF-8, nothing may be held back.
            assert emitted == data[: i + 1].decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" not in emitted and TEXT.startswith(emitted)
    assert detok.flush() == ""
    assert emitted == TEXT


def _random_bytes(rng: random.Random, n: int) -> bytes:
    """Mostly valid text (ASCII, accents, CJK, emoji), with some stray bytes and cut characters."""
    alphabet = ["a", " ", "é", "Ж", "世", "界", "😀", "👍🏽", "\n"]
    out = bytearray()
    while len(out) < n:
        r = rng.random()
        if r < 0.8:
            out += rng.choice(alphabet).encode()
        elif r < 0.9:
            out += rng.choice(alphabet[2:]).encode()[:-1]  # a character cut short
        else:
            out.append(rng.randrange(0x80, 0x100))  # a stray continuation or lead byte
    return bytes(out)


def test_random_bytes_random_splits_match_full_decode(tok):
    rng = random.Random(0)
    for trial in range(300):
        data = _random_bytes(rng, rng.randint(0, 40))
        ids = ids_of(data)
        final = tok.decode(ids)
        detok = IncrementalDetokenizer(tok)
        emitted = ""
        for chunk in split(ids, rng):
            piece = detok.add(chunk)
            emitted += piece
            # Every piece is final: the stream so far is a prefix of the whole
            # decode, so a U+FFFD appears only where the final text has one.
            assert final.startswith(emitted), (trial, data, emitted)
        emitted += detok.flush()
        assert emitted == final, (trial, data)


def test_incomplete_tail_is_released_by_flush(tok):
    detok = IncrementalDetokenizer(tok)
    data = "ok😀".encode()[:-2]
    assert detok.add(ids_of(data)) == "ok"
    assert detok.flush() == tok.decode(ids_of(data))[2:] == "\ufffd"
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = ids_of(b"hi") + [EOT] + ids_of(b"!")
    assert "".join(stream(IncrementalDetokenizer(tok), [[i] for i in ids])) == "hi!"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), [[i] for i in ids]))
    assert kept == tok.decode(ids, skip_special_tokens=False) == "hi<|eot_id|>!"


def test_prompt_context_byte_level(tok):
    prompt = [BOS_ID] + ids_of("prompt 世".encode())
    gen = ids_of(" 界😀 end".encode())
    rng = random.Random(1)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
        assert "".join(stream(detok, split(gen, rng))) == " 界😀 end"


def test_random_prompts_and_streams_match_full_decode(tok):
    """A prompt may end inside a character (a lead byte, say): the generated bytes after it
    still stream as they decode on their own, one character neither merged nor lost."""
    rng = random.Random(2)
    for trial in range(300):
        prompt = ids_of(_random_bytes(rng, rng.randint(1, 8)))
        ids = ids_of(_random_bytes(rng, rng.randint(1, 30)))
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
        emitted = "".join(stream(detok, split(ids, rng))) + detok.flush()
        assert emitted == tok.decode(ids), (trial, prompt, ids)


def test_sentencepiece_leading_space(sp_tok):
    # Decoded one token at a time, "\u2581world" would lose its space.
    ids = [1, 2, 3, 4, 5]
    assert sp_tok.decode(ids) == "Hello world! ab"
    assert "".join(stream(IncrementalDetokenizer(sp_tok), [[i] for i in ids])) == "Hello world! ab"
    # After a prompt, the first generated token keeps its space.
    detok = IncrementalDetokenizer(sp_tok, prompt_ids=[1])
    assert detok.add([2]) == " world"
    assert detok.add([3]) == "!"


# ---------------------------------------------------------------- stop checker


def run(tok, text_or_ids, checker: StopChecker, chunk: int = 1):
    """Feeds tokens `chunk` at a time; returns (streamed pieces, kept ids, finish reason)."""
    ids = ids_of(text_or_ids.encode()) if isinstance(text_or_ids, str) else list(text_or_ids)
    detok = IncrementalDetokenizer(tok)
    pieces, kept = [], []
    for i in range(0, len(ids), chunk):
        r = checker.update(ids[i : i + chunk], detok)
        pieces.append(r.text)
        kept += r.token_ids
        if r.finished:
            break
    if not checker.finished:  # the engine ran out of tokens: release the rest
        pieces.append(checker.flush(detok))
    return pieces, kept, checker.finish_reason


def stop_prefix_ok(pieces: list[str], stops: list[str]) -> None:
    """No streamed prefix ever ends in a whole stop string."""
    so_far = ""
    for p in pieces:
        so_far += p
        assert not any(s in so_far for s in stops), (pieces, stops)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_stop_string_spanning_tokens(tok, chunk):
    checker = StopChecker(stop=["STOP"])
    pieces, kept, reason = run(tok, "hello STOP world", checker, chunk)
    assert "".join(pieces) == "hello "
    assert reason == FinishReason("stop", matched="STOP")
    # Output ids end at the token that completed the stop string (SGLang's output_ids).
    assert kept == ids_of(b"hello STOP")
    stop_prefix_ok(pieces, ["STOP"])
    # Nothing of the stop string was ever streamed, not even "S" while it was pending.
    assert "S" not in "".join(pieces)


def test_stop_at_first_token(tok):
    pieces, kept, reason = run(tok, "Xabc", StopChecker(stop=["X"]))
    assert "".join(pieces) == "" and kept == [ord("X")] and reason.matched == "X"
    pieces, kept, reason = run(tok, [EOT, 65], StopChecker(eos_token_ids=EOS_IDS))
    assert "".join(pieces) == "" and kept == [EOT] and reason == FinishReason("stop", matched=EOT)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_prefix_of_another(tok, chunk):
    # "ab" completes first, wherever the tokens are cut.
    for stops in (["ab", "abc"], ["abc", "ab"]):
        pieces, _, reason = run(tok, "xxabcd", StopChecker(stop=stops), chunk)
        assert "".join(pieces) == "xx" and reason.matched == "ab"
    # A shorter string inside a longer one completes first.
    pieces, kept, reason = run(tok, "zabcd", StopChecker(stop=["abcd", "bc"]), chunk)
    assert "".join(pieces) == "za" and reason.matched == "bc" and kept == ids_of(b"zabc")
    # Completed by the same character: the longest wins (output ends earliest).
    pieces, _, reason = run(tok, "zabc", StopChecker(stop=["bc", "abc"]), chunk)
    assert "".join(pieces) == "z" and reason.matched == "abc"


def test_held_back_partial_match_released_later(tok):
    checker = StopChecker(stop=["abc"])
    detok = IncrementalDetokenizer(tok)
    assert checker.update(ids_of(b"xa"), detok).text == "x"  # "a" may start "abc"
    assert checker.update(ids_of(b"b"), detok).text == ""  # "ab" too
    assert checker.update(ids_of(b"d"), detok).text == "abd"  # not a stop after all
    assert checker.update(ids_of(b"aab"), detok).text == "a"  # "ab" held, first "a" freed
    r = checker.update(ids_of(b"abc"), detok)  # "ababc": the match starts inside the new text
    assert r.text == "ab" and r.finish_reason.matched == "abc"


def test_overlapping_partial_match(tok):
    pieces, _, reason = run(tok, "aaab", StopChecker(stop=["aab"]))
    assert "".join(pieces) == "a" and reason.matched == "aab"
    stop_prefix_ok(pieces, ["aab"])


def test_partial_match_released_at_end_of_stream(tok):
    # Finished by EOS: the held "ST" was text, not a stop.
    pieces, kept, reason = run(tok, ids_of(b"go ST") + [EOS_IDS[0]], StopChecker(stop=["STOP"], eos_token_ids=EOS_IDS))
    assert "".join(pieces) == "go ST" and reason.matched == EOS_IDS[0]
    # Finished by length.
    pieces, kept, reason = run(tok, "go STxx", StopChecker(stop=["STOP"], max_new_tokens=5))
    assert "".join(pieces) == "go ST" and reason == FinishReason("length", length=5) and len(kept) == 5


def test_multibyte_stop_string(tok):
    # The stop string's bytes arrive one token each; its first byte alone is U+FFFD text.
    for chunk in (1, 2, 5):
        pieces, kept, reason = run(tok, "数据世界 after", StopChecker(stop=["世界"]), chunk)
        assert "".join(pieces) == "数据" and reason.matched == "世界"
        assert all("\ufffd" not in p for p in pieces)


def test_stop_token_ids(tok):
    nl = ord("\n")
    # A stop token counts and is kept in the ids, but its text is not shown;
    # the speculative tokens after it are dropped.
    checker = StopChecker(stop_token_ids={nl}, max_new_tokens=100)
    pieces, kept, reason = run(tok, "line one\nline two", checker, chunk=5)
    assert "".join(pieces) == "line one" and kept == ids_of(b"line one\n")
    assert reason == FinishReason("stop", matched=nl) and checker.num_tokens == 9
    # Later updates (the one-step lag) add nothing.
    r = checker.update(ids_of(b"more"), IncrementalDetokenizer(tok))
    assert r.token_ids == [] and r.text == "" and r.finish_reason == reason
    assert reason.to_json() == {"type": "stop", "matched": nl}


def test_stop_token_releases_incomplete_character(tok):
    data = "ab😀".encode()[:-1]
    pieces, kept, _ = run(tok, ids_of(data) + [EOT], StopChecker(eos_token_ids=EOS_IDS))
    assert "".join(pieces) == tok.decode(ids_of(data)) == "ab\ufffd"


def test_ignore_eos(tok):
    ids = ids_of(b"ab") + [EOT] + ids_of(b"cd") + [ord(";")] + ids_of(b"ef")
    checker = StopChecker(stop_token_ids={ord(";")}, eos_token_ids=EOS_IDS, ignore_eos=True)
    pieces, kept, reason = run(tok, ids, checker, chunk=3)
    # EOS is an ordinary (special, so textless) token; the explicit stop id still stops.
    assert "".join(pieces) == "abcd" and reason.matched == ord(";")
    assert kept == ids[:6]
    # Without ignore_eos, EOS stops.
    pieces, kept, reason = run(tok, ids, StopChecker(stop_token_ids={ord(";")}, eos_token_ids=EOS_IDS))
    assert "".join(pieces) == "ab" and reason.matched == EOT and kept == ids[:3]


@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_max_new_tokens(tok, chunk):
    checker = StopChecker(max_new_tokens=4)
    pieces, kept, reason = run(tok, "abcdefgh", checker, chunk)
    assert "".join(pieces) == "abcd" and kept == ids_of(b"abcd") and checker.num_tokens == 4
    assert reason.to_json() == {"type": "length", "length": 4}
    # A stop on the last allowed token is reported as "stop".
    checker = StopChecker(eos_token_ids=EOS_IDS, max_new_tokens=4)
    pieces, kept, reason = run(tok, ids_of(b"abc") + [EOT, 65], checker, chunk)
    assert "".join(pieces) == "abc" and reason.matched == EOT
    pieces, kept, reason = run(tok, "abXY", StopChecker(stop=["XY"], max_new_tokens=4), chunk)
    assert "".join(pieces) == "ab" and reason.matched == "XY"
    # A length stop releases an incomplete character as the tokenizer decodes it.
    data = "ab😀".encode()
    pieces, kept, reason = run(tok, data, StopChecker(max_new_tokens=4), chunk)
    assert "".join(pieces) == tok.decode(ids_of(data[:4])) == "ab\ufffd" and reason.type == "length"


def test_max_new_tokens_zero_and_errors(tok):
    checker = StopChecker(max_new_tokens=0)
    assert checker.finished and checker.update([65], IncrementalDetokenizer(tok)).token_ids == []
    with pytest.raises(ValueError):
        StopChecker(max_new_tokens=-1)
    with pytest.raises(ValueError):
        StopChecker(stop=["x"]).update([65])
    # Without a detokenizer, token conditions still work.
    r = StopChecker(eos_token_ids=EOS_IDS).update([65, 66, EOT, 67])
    assert r.token_ids == [65, 66, EOT] and r.text == "" and r.finish_reason.matched == EOT


def test_random_streams_match_one_shot(tok):
    """Streaming any split gives the same result as feeding everything at once."""
    rng = random.Random(2)
    stops = ["ab", "世界", "a b", "xyz"]
    for _ in range(200):
        alphabet = ["a", "b", " ", "世", "界", "x", "y", "z", "😀"]
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = ids_of(data.encode())
        whole = run(tok, ids, StopChecker(stop=stops, max_new_tokens=40), chunk=len(ids))
        pieces, kept, reason = run(tok, ids, StopChecker(stop=stops, max_new_tokens=40), chunk=rng.randint(1, 5))
        assert ("".join(pieces), kept, reason) == ("".join(whole[0]), whole[1], whole[2])
        stop_prefix_ok(pieces, stops)
        if reason is None:
            expected = data
        elif reason.type == "length":
            expected = tok.decode(ids[:40])
        else:  # the text ends just before the stop string completed first
            expected = data[: min((data.find(s) + len(s), data.find(s)) for s in stops if s in data)[1]]
        assert "".join(pieces) == expected
