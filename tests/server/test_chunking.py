"""Sentence chunker: boundaries (English, Korean, newlines, max length) and lossless joins."""

from __future__ import annotations

import random

import pytest

from edgellm.server.chunking import SentenceChunker, is_sentence_end


def chunk(text: str, max_chars: int = 200, seed: int = 0, pieces: list[str] | None = None) -> list[str]:
    """Feed text in random small deltas (as tokens arrive), then flush."""
    rng = random.Random(seed)
    if pieces is None:
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 5)
            pieces.append(text[i:i + k])
            i += k
    c = SentenceChunker(max_chars)
    out: list[str] = []
    for p in pieces:
        out += c.push(p)
    rest = c.flush()
    if rest:
        out.append(rest)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_english_sentences(seed):
    text = "Hello there. How are you today? I am fine! Thanks for asking."
    assert chunk(text, seed=seed) == ["Hello there. ", "How are you today? ", "I am fine! ", "Thanks for asking."]


@pytest.mark.parametrize("seed", range(5))
def test_korean_sentence_ends_with_and_without_spaces(seed):
    text = "안녕하세요.저는 학생입니다. 오늘 뭐 하세요?그래요! 같이 갈까? 좋아요"
    assert chunk(text, seed=seed) == ["안녕하세요.", "저는 학생입니다. ", "오늘 뭐 하세요?", "그래요! ",
                                      "같이 갈까? ", "좋아요"]


def test_full_width_punctuation_ends_at_once():
    assert chunk("你好。我很好！谢谢", pieces=["你好。", "我很好！", "谢谢"]) == ["你好。", "我很好！", "谢谢"]


def test_not_a_boundary():
    # decimals, abbreviations, dots inside words
    text = "Pi is 3.14 roughly. Dr. Smith met Mrs. Jones at example.com today. Done"
    assert chunk(text) == ["Pi is 3.14 roughly. ", "Dr. Smith met Mrs. Jones at example.com today. ", "Done"]


def test_quotes_and_ellipsis_stay_with_the_sentence():
    text = 'He said "stop." Then he left... (Why?) Nobody knows.'
    assert chunk(text) == ['He said "stop." ', "Then he left... ", "(Why?) ", "Nobody knows."]


def test_newline_ends_a_chunk_and_blank_lines_join_the_next():
    text = "First line\n\nSecond line\nThird"
    out = chunk(text)
    assert "".join(out) == text
    assert out == ["First line\n", "\nSecond line\n", "Third"]


def test_waits_for_the_next_character():
    c = SentenceChunker()
    assert c.push("It costs 3.") == []  # could be 3.5
    assert c.push("5 dollars.") == []
    assert c.push(" Next") == ["It costs 3.5 dollars. "]
    assert c.flush() == "Next"


@pytest.mark.parametrize("max_chars", [8, 20, 50])
def test_max_length_cuts_at_spaces(max_chars):
    text = ("word " * 40).strip() + " and then a very long clause without any stop at all " * 3
    out = chunk(text, max_chars=max_chars)
    assert "".join(out) == text
    assert all(len(c) <= max_chars for c in out)
    assert len(out) > 1


def test_max_length_hard_cut_without_spaces():
    text = "x" * 95
    out = chunk(text, max_chars=30)
    assert out == ["x" * 30] * 3 + ["x" * 5]


def test_long_sentence_in_one_delta_is_still_bounded():
    text = "This is a long sentence that goes on and on and on. Short."
    out = chunk(text, max_chars=20, pieces=[text])
    assert "".join(out) == text
    assert all(len(c) <= 20 for c in out)


@pytest.mark.parametrize("seed", range(20))
def test_random_text_joins_losslessly_and_ends_at_boundaries(seed):
    rng = random.Random(seed)
    alphabet = list("abc 가나다 ") + [". ", "? ", "!", ".", "\n", "요.", "다. ", "까?", "3.1", "\"", "…"]
    text = "".join(rng.choice(alphabet) for _ in range(300))
    out = chunk(text, max_chars=40, seed=seed)
    assert "".join(out) == text
    for c in out[:-1]:
        assert len(c) <= 40
        # a sentence end, or a length cut (at a space, or hard at the limit)
        assert is_sentence_end(c) or c.endswith(" ") or len(c) == 40, repr(c)
    assert sum(is_sentence_end(c) for c in out) >= 5


def test_bad_max_chars():
    with pytest.raises(ValueError):
        SentenceChunker(3)
