"""Incremental detokenization keeps multi-byte characters whole; stop strings are found across deltas and trimmed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tandem.services.router.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer whose vocabulary is the 256 single bytes: every multi-byte character spans tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_split_multibyte_characters_are_held_until_complete(byte_tokenizer):
    text = "héllo 世界 🙂!"
    ids = byte_tokenizer.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    detok = IncrementalDetokenizer(byte_tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    emoji_start = len("héllo 世界 ".encode("utf-8"))
    assert pieces[emoji_start:emoji_start + 3] == ["", "", ""]  # 4-byte emoji: nothing until its last byte
    assert pieces[emoji_start + 3] == "🙂"


def test_tiny_model_tokenizer_round_trips_streamed_text(tiny_llama):
    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    text = "The quick brown fox — naïve café, 東京 and ☕ in one line."
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i:i + 2]) for i in range(0, len(ids), 2)) + detok.flush()
    assert out == text


def test_stop_string_split_across_deltas_is_trimmed():
    matcher = StopStringMatcher(["STOP"])
    out1, hit1 = matcher.feed("hello ST")
    assert (out1, hit1) == ("hello ", False)  # "ST" may begin the stop string: held back
    out2, hit2 = matcher.feed("OP and more")
    assert (out2, hit2) == ("", True)


def test_held_text_is_released_when_it_turns_out_not_to_stop():
    matcher = StopStringMatcher(["\n\n", "END"])
    assert matcher.feed("line\n") == ("line", False)
    assert matcher.feed("next E") == ("\nnext ", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == "E"


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.feed("more") == ("", True)


def test_a_real_replacement_character_is_emitted_not_held_forever(byte_tokenizer):
    from tandem.services.router.detokenizer import MAX_HELD_TOKENS

    lead = byte_tokenizer.encode("世").ids[0]  # the first byte of a 3-byte character, alone it never completes
    hello = byte_tokenizer.encode("hi").ids
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert detok.push(hello) == "hi"
    pieces = [detok.push([lead]) for _ in range(MAX_HELD_TOKENS)]
    assert pieces[:-1] == [""] * (MAX_HELD_TOKENS - 1) and "\ufffd" in pieces[-1]  # released once too many wait
    assert detok.push(hello) == "hi"  # and the stream goes on after it
    assert detok.push([lead]) == ""
    assert detok.flush() == "\ufffd"  # the sequence ended mid-character: shown as is
    assert detok.flush() == ""


def test_text_depends_on_the_ids_not_on_their_chunking(tiny_llama):
    """Random ids of the tiny model (a random model's output: stray bytes of multi-byte characters among whole
    ones) read the same streamed one token at a time, in random chunks, all at once, and decoded whole: a migrated
    stream and a whole response carry the same text (chunked steps once held different windows back)."""
    import random

    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(48)]
        texts = set()
        for chunk in (lambda: 1, lambda: len(ids), lambda: rng.randint(2, 6)):
            detok, out, at = IncrementalDetokenizer(tok), "", 0
            while at < len(ids):
                size = chunk()
                out, at = out + detok.push(ids[at:at + size]), at + size
            texts.add(out + detok.flush())
        assert texts == {tok.decode(ids)}, ids
