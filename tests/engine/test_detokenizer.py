"""Tests for the incremental detokenizer and stop strings (qwick/engine/detokenizer.py).

The tokenizer is transformers' Qwen2Tokenizer (Qwen2's pre-tokenizer regex, NFC, byte-level BPE and
decoder) over a tiny vocabulary trained here without network: small enough that CJK characters and emoji
are split into byte pieces across tokens, as the real Qwen vocabulary often does.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from qwick.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; i++) { printf("%d\\n", i); }',
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "机器学习是人工智能的一个分支。",
    "emoji 😀🎉 party 👍",
]

TEXTS = {
    "english": "Hello world! The lazy dog sleeps; the quick fox jumps over it.",
    "code": 'def add(a, b):\n    """Add."""\n    return a + b  # 💡\n\nprint(add(1, 2))\n',
    "emoji": "Party time 😀🎉👍🏽 yes 🇺🇳!",
    "chinese": "你好，世界！机器学习很有趣，深度学习更有趣。龘靐齉",
    "mixed": "Qwen 说：「你好」👋 and then `x = 1` — done…",
}


@pytest.fixture(scope="module")
def tok() -> Qwen2Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    model = json.loads(bpe.to_str())["model"]
    t = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return t


def stream(tok, ids, prompt=(), chunks=None, **kwargs):
    """Feed ids (one at a time, or in the given chunk sizes); return (detokenizer, deltas, stop)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    deltas = []
    stop = None
    i = 0
    sizes = iter(chunks) if chunks is not None else None
    while i < len(ids):
        n = next(sizes, 1) if sizes is not None else 1
        stop = d.update(ids[i : i + n])
        i += n
        deltas.append(d.get_delta())
        if stop is not None:
            break
    if stop is None:
        deltas.append(d.flush())
    return d, deltas, stop


def test_fixture_splits_characters_across_tokens(tok):
    # The tests below only mean something if some tokens hold part of a UTF-8 character.
    for name in ("chinese", "emoji"):
        ids = tok.encode(TEXTS[name])
        partial = [i for i in ids if "\ufffd" in tok.decode([i])]
        assert partial, name
    assert tok.decode(tok.encode(TEXTS["mixed"])) == TEXTS["mixed"]


@pytest.mark.parametrize("name", list(TEXTS))
def test_streamed_deltas_concatenate_to_full_decode(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    prompt = tok.encode("<|im_start|>user\nhi 你<|im_end|>\n<|im_start|>assistant\n")
    for chunks in (None, [2, 3, 1, 5, 4] * 50, [len(ids)]):
        d, deltas, stop = stream(tok, ids, prompt=prompt, chunks=chunks)
        assert stop is None
        assert "".join(deltas) == text
        assert d.output_text == text
        assert all("\ufffd" not in delta for delta in deltas)
    # One id at a time, some updates release nothing (an incomplete character is held back).
    if name in ("chinese", "emoji"):
        _, deltas, _ = stream(tok, ids, prompt=prompt)
        assert "" in deltas[:-1]


def test_random_chunking_and_random_texts(tok):
    rng = random.Random(0)
    alphabet = list("abc xyz,.!\n") + list("你好世界学习龘") + ["😀", "👍🏽", "é", "ß"]
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text)
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        d, deltas, _ = stream(tok, ids, chunks=chunks)
        expected = tok.decode(ids)
        assert "".join(deltas) == expected == d.output_text
        assert all("\ufffd" not in x for x in deltas)


def test_incomplete_tail_released_by_flush(tok):
    ids = tok.encode(TEXTS["chinese"])
    # Cut inside a character: the last id is a partial byte piece.
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, [])
    deltas = []
    for t in ids[:cut]:
        d.update([t])
        deltas.append(d.get_delta())
    assert all("\ufffd" not in x for x in deltas)
    assert not d.output_text.endswith("\ufffd")
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids[:cut]) == d.output_text
    assert d.output_text.endswith("\ufffd")


def test_decode_window_stays_small(tok):
    # O(new tokens) per update: the ids decoded each step do not grow with the output.
    ids = tok.encode(" ".join([TEXTS["english"], TEXTS["chinese"], TEXTS["emoji"]]) * 20)
    d = IncrementalDetokenizer(tok, tok.encode("prompt text here"))
    lengths = []
    inner = d._decode

    def counting(x):
        lengths.append(len(x))
        return inner(x)

    d._decode = counting
    for t in ids:
        d.update([t])
    assert max(lengths) <= 8
    assert d.output_text == tok.decode(ids)


# ---------------------------------------------------------------- stop strings


def _multi_char_token(tok, ids):
    for k, t in enumerate(ids):
        piece = tok.decode([t])
        if len(piece) >= 3 and "\ufffd" not in piece and piece.strip() == piece:
            return k, piece
    raise AssertionError("no multi-character token")


def test_stop_in_middle_of_token(tok):
    text = TEXTS["english"]
    ids = tok.encode(text)
    k, piece = _multi_char_token(tok, ids)
    stop = piece[1]
    assert stop not in tok.decode(ids[:k])
    d, deltas, reason = stream(tok, ids, stop=[stop])
    assert reason == stop and d.stop_reason == stop and d.finished
    before = tok.decode(ids[:k]) + piece[0]
    assert d.output_text == before
    assert "".join(deltas) == before
    # Including the stop: cut right after it, even though the token goes on.
    d, deltas, reason = stream(tok, ids, stop=[stop], include_stop_str_in_output=True)
    assert d.output_text == before + stop == "".join(deltas)


def test_stop_spanning_two_tokens(tok):
    ids = tok.encode(TEXTS["english"])
    k, piece = _multi_char_token(tok, ids)
    nxt = tok.decode([ids[k + 1]])
    stop = piece[-2:] + nxt[:2]
    assert stop not in tok.decode(ids[: k + 1])
    d, deltas, reason = stream(tok, ids, stop=[stop])
    assert reason == stop
    assert d.num_output_tokens == k + 2  # found when its last character arrives
    assert d.output_text == tok.decode(ids[: k + 1])[:-2] == "".join(deltas)


def test_stop_spanning_many_tokens_of_split_characters(tok):
    ids = tok.encode(TEXTS["chinese"])
    stop = "机器学习很"
    d, deltas, reason = stream(tok, ids, stop=[stop])
    assert reason == stop
    assert d.output_text == "你好，世界！" == "".join(deltas)
    d, deltas, _ = stream(tok, ids, stop=["😀"])  # never appears
    assert d.output_text == TEXTS["chinese"]


def test_stop_at_the_very_end(tok):
    text = TEXTS["english"]
    ids = tok.encode(text)
    d, deltas, reason = stream(tok, ids, stop=["it."])
    assert reason == "it."
    assert d.num_output_tokens == len(ids)
    assert d.output_text == text[: -len("it.")] == "".join(deltas)
    d, deltas, reason = stream(tok, ids, stop=["it."], include_stop_str_in_output=True)
    assert d.output_text == text == "".join(deltas)


def test_stop_string_of_emoji_split_across_tokens(tok):
    ids = tok.encode(TEXTS["emoji"])
    d, deltas, reason = stream(tok, ids, stop=["🎉"])
    assert reason == "🎉"
    assert d.output_text == "Party time 😀" == "".join(deltas)


def test_multiple_stops_earliest_wins(tok):
    text = TEXTS["english"]
    ids = tok.encode(text)
    d, _, reason = stream(tok, ids, stop=["fox", "lazy", "quick"])
    assert reason == "lazy"
    assert d.output_text == "Hello world! The "
    # All at once: still the stop that completes first in the text.
    d, deltas, reason = stream(tok, ids, chunks=[len(ids)], stop=["fox", "quick", "dog"])
    assert reason == "dog" and d.output_text == "Hello world! The lazy " == "".join(deltas)
    # One stop inside another: the one that completes first wins, as a character stream would see it.
    d, _, reason = stream(tok, ids, chunks=[len(ids)], stop=["lazy dog", "azy"])
    assert reason == "azy" and d.output_text == "Hello world! The l"
    # Same end: the longer one.
    d, _, reason = stream(tok, ids, chunks=[len(ids)], stop=["zy", "lazy"])
    assert reason == "lazy" and d.output_text == "Hello world! The "


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("name", ["english", "code", "chinese", "mixed"])
def test_hold_back_never_leaks_stop_prefix(tok, name, include):
    """At every step, what was released is a prefix of the final text (which ends before the stop)."""
    text = TEXTS[name]
    ids = tok.encode(text)
    rng = random.Random(sum(map(ord, name)))
    for _ in range(15):
        a = rng.randrange(0, len(text) - 1)
        stop = text[a : a + rng.randint(1, 6)]
        if not stop.strip():
            continue
        first = text.find(stop)
        expected = text[: first + len(stop)] if include else text[:first]
        # A decoy that shares a prefix with the stop but never occurs: its hold-back must be released.
        decoy = stop[:-1] + "\x00" if len(stop) > 1 else "\x00\x00\x00"
        d = IncrementalDetokenizer(tok, [], stop=[decoy, stop], include_stop_str_in_output=include)
        released = ""
        reason = None
        for t in ids:
            reason = d.update([t])
            released += d.get_delta()
            # Whatever was handed out is final: never a character the stop will cut off.
            assert expected.startswith(released)
            if reason is not None:
                break
        if reason is None:
            released += d.flush()
        assert reason == stop
        assert d.output_text == expected
        assert released == expected


def test_partial_stop_match_is_released_at_finish(tok):
    text = TEXTS["english"]
    ids = tok.encode(text)
    d, deltas, reason = stream(tok, ids, stop=["it!!!"])
    assert reason is None
    assert "".join(deltas) == text
    # Before the flush the last (len - 1) characters were held back.
    assert "".join(deltas[:-1]) == text[: -(len("it!!!") - 1)]


def test_no_hold_back_when_stop_is_included(tok):
    text = TEXTS["english"]
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["zzzzzz"], include_stop_str_in_output=True)
    d.update(ids)
    assert d.get_delta() == text


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.encode(TEXTS["english"])
    d, _, reason = stream(tok, ids, stop=["Hello"], min_tokens=len(ids))
    assert reason is None and d.output_text == TEXTS["english"]
    d, _, reason = stream(tok, ids, stop=["Hello"])
    assert reason == "Hello" and d.output_text == ""


def test_updates_after_stop_are_ignored(tok):
    ids = tok.encode(TEXTS["english"])
    d = IncrementalDetokenizer(tok, [], stop=["world"])
    assert d.update(ids[:5]) == "world"
    text = d.output_text
    assert d.update(ids[5:]) is None
    assert d.output_text == text
    assert d.flush() == text
    assert d.get_delta() == ""


def test_empty_update_and_empty_stop_list(tok):
    d = IncrementalDetokenizer(tok, [])
    assert d.update([]) is None
    assert d.get_delta() == ""
    d.update(tok.encode("Hello"))
    assert d.get_delta() == "Hello"  # no stops: nothing held back


# ---------------------------------------------------------------- special tokens


def test_skip_special_tokens(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tok.encode("Hello 你好") + [im_end] + tok.encode(" world") + [eos]
    d, deltas, _ = stream(tok, ids)
    assert d.output_text == "Hello 你好 world" == "".join(deltas)
    d, deltas, _ = stream(tok, ids, skip_special_tokens=False)
    assert d.output_text == "Hello 你好<|im_end|> world<|endoftext|>" == "".join(deltas)
    # A stop string can match the text of a special token when it is not skipped.
    d, deltas, reason = stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert reason == "<|im_end|>" and d.output_text == "Hello 你好"


def test_stop_terminated_token_text_not_added(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello")
    for include, expected in ((False, "Hello"), (True, "Hello<|im_end|>")):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=False, include_stop_str_in_output=include)
        d.update(ids)
        d.update([im_end], stop_terminated=True)
        assert d.get_delta() + d.flush() == expected == d.output_text
        assert d.output_token_ids == ids + [im_end]


def test_works_with_bare_tokenizers_tokenizer(tok):
    ids = tok.encode(TEXTS["mixed"])
    d, deltas, _ = stream(tok.backend_tokenizer, ids)
    assert "".join(deltas) == TEXTS["mixed"]


def test_deferred_decoding_gives_the_per_update_text(tok):
    """`defer=True`: updates only collect ids; the text, decoded when read, is what per-update decoding
    gives, for split characters, special tokens, a stop token and an incomplete tail alike."""
    rng = random.Random(1)
    alphabet = list("abc xyz,.!\n") + list("你好世界学习龘") + ["😀", "👍🏽", "é", "ß"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.encode("<|im_start|>user\nhi 你<|im_end|>\n<|im_start|>assistant\n")
    for trial in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text)
        if trial % 3 == 0:
            ids = ids[: rng.randint(1, len(ids))]  # may end inside a character
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        stop_token = trial % 2 == 0
        skip = trial % 4 != 1
        texts = []
        for defer in (False, True):
            d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, defer=defer)
            i = 0
            for n in chunks:
                if i >= len(ids):
                    break
                assert d.update(ids[i : i + n]) is None
                i += n
            if stop_token:
                d.update([im_end], stop_terminated=True)
            d.flush()
            texts.append(d.output_text)
            assert d.output_token_ids == ids + ([im_end] if stop_token else [])
        assert texts[0] == texts[1], (text, ids)


def test_deferred_decoding_decodes_only_when_read(tok):
    d = IncrementalDetokenizer(tok, tok.encode("hi"), defer=True)
    calls = []
    decode = d._decode
    d._decode = lambda ids: calls.append(len(ids)) or decode(ids)
    ids = tok.encode(TEXTS["mixed"])
    for t in ids:
        d.update([t])
    assert calls == []
    assert d.output_text == TEXTS["mixed"]
    assert len(calls) == 2  # the whole window once, then its context for the next read
    assert d.get_delta() + d.flush() == TEXTS["mixed"]
    # With stop strings the ids are decoded as they come (a stop must end the sequence when it appears).
    d, _, stop = stream(tok, tok.encode(TEXTS["english"]), stop=["lazy"], defer=True)
    assert stop == "lazy" and d.output_text == "Hello world! The "
