"""Incremental detokenization for streaming: the text grows by decoding only the newest
tokens and is always a prefix of the whole output's decode."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from dllm.stop import IncrementalText
from dllm.testing import make_tiny_checkpoint


def _tokenizer(tmp_path):
    path = make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=0)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_incremental_text_equals_the_full_decode(tmp_path):
    tok = _tokenizer(tmp_path)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    text = "Déjà vu: 17 + 25 = 42 — naïve café ☕ résumé, 北京 and 東京!\n" * 5
    ids = tok.encode(text, add_special_tokens=False)
    special = tok.convert_tokens_to_ids(tok.all_special_tokens[0])
    ids = ids[:40] + [special] + ids[40:]  # a skipped special token in the middle
    rng = random.Random(0)
    for _ in range(20):  # random block sizes, as blocks commit
        inc, n = IncrementalText(decode), 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, 9))
            got = inc.update(ids[:n])
            assert decode(ids[:n]).startswith(got)
        assert got == decode(ids) == text


def test_incremental_text_is_a_prefix_for_any_tokens(tmp_path):
    """Random ids split multi-byte characters anywhere: the text holds back a trailing
    incomplete character and never disagrees with the whole decode."""
    tok = _tokenizer(tmp_path)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(1)
    ascii_end = tok.encode("x.", add_special_tokens=False)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(200)]
        inc, n = IncrementalText(decode), 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, 6))
            got = inc.update(ids[:n])
            assert decode(ids[:n]).startswith(got)
        # Once the output ends on a whole character, nothing is held back.
        assert inc.update(ids + ascii_end) == decode(ids + ascii_end)


def _first_stop_whole(decode, prev, new, stops):
    """The reference: the whole output decoded at every candidate length."""
    if not new:
        return None
    horizon = max(0, len(decode(prev)) - max(len(s) for s in stops) + 1)
    for k in range(1, len(new) + 1):
        text = decode(prev + new[:k])[horizon:]
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return k, min(hits)[1]
    return None


def test_windowed_stop_search_equals_the_whole_decode(tmp_path):
    """The stop-string search decodes only the end of the output; block after block it finds
    the same first stop (and the same token count) as decoding the whole output each time."""
    from dllm.stop import StopChecker

    tok = _tokenizer(tmp_path)
    checker = StopChecker(tok, ())
    text = "Déjà vu: 17 + 25 = 42 — naïve café ☕ résumé, 北京 and 東京! The end.\n" * 4
    clean = tok.encode(text, add_special_tokens=False)
    rng = random.Random(2)
    hits = 0
    for trial in range(60):
        ids = clean if trial % 2 == 0 else [rng.randrange(len(tok)) for _ in range(150)]
        full = checker.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):  # pieces of the text, so some of them occur
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randint(1, 6)] or "z")
        inc = IncrementalText(checker.decode)
        n = 0
        while n < len(ids):
            block = ids[n : n + rng.randint(1, 8)]
            got = checker._first_stop_string(inc, ids[:n], block, stops)
            assert got == _first_stop_whole(checker.decode, ids[:n], block, stops)
            if got is not None:
                hits += 1
                break
            n += len(block)
    assert hits >= 30  # the comparison covered real matches, not only misses
