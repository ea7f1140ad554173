"""Prompt synthesis: hash ids -> token blocks, exact prefix sharing, stable text rendering."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.prompts import WORDS, PromptSynth, count_words


def test_shared_hash_ids_give_identical_tokens_and_nothing_more() -> None:
    s = PromptSynth(16, seed=7)
    a = s.token_ids([10, 11, 12, 13], 60)
    b = s.token_ids([10, 11, 99, 13], 64)
    assert a.shape == (60,) and b.shape == (64,)
    assert np.array_equal(a[:32], b[:32])
    # the first differing block differs (almost) everywhere, and the same id at a later
    # position after a divergence still yields the same block content
    assert np.count_nonzero(a[32:48] != b[32:48]) >= 12
    assert np.array_equal(a[48:60], b[48:60])


def test_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    s = PromptSynth(512)
    full = s.token_ids([1, 2], 1024)
    part = s.token_ids([1, 2], 513)
    assert part.shape == (513,)
    assert np.array_equal(part, full[:513])


def test_deterministic_across_instances_and_seeded() -> None:
    ids = list(range(50))
    a = PromptSynth(16, seed=3).token_ids(ids, 800)
    b = PromptSynth(16, seed=3).token_ids(ids, 800)
    c = PromptSynth(16, seed=4).token_ids(ids, 800)
    assert np.array_equal(a, b)
    assert np.count_nonzero(a != c) > 700
    # distinct ids give distinct blocks
    blocks = {tuple(row) for row in PromptSynth(16).blocks(ids)}
    assert len(blocks) == 50


def test_token_range() -> None:
    s = PromptSynth(16, vocab_size=100, token_offset=5)
    t = s.token_ids(list(range(200)), 3200)
    assert t.min() >= 5 and t.max() < 105
    assert len(np.unique(t)) == 100


@pytest.mark.parametrize(("n_ids", "length"), [(2, 16), (2, 33), (1, 0), (3, 49)])
def test_length_must_fit_the_blocks(n_ids: int, length: int) -> None:
    with pytest.raises(ValueError, match="input_length"):
        PromptSynth(16).token_ids(list(range(n_ids)), length)


def test_bad_parameters_name_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PromptSynth(0)
    with pytest.raises(ValueError, match="vocab_size"):
        PromptSynth(16, vocab_size=0)


def test_text_mode_one_word_per_token_and_prefix_stable() -> None:
    s = PromptSynth(16, seed=1)
    short = s.text([5, 6], 32)
    long = s.text([5, 6, 7], 40)
    assert count_words(short) == 32 and count_words(long) == 40
    assert long.startswith(short)
    assert all(w in WORDS for w in long.split())
    assert len(set(WORDS)) == len(WORDS)


def test_text_mode_tokenizes_stably_with_a_real_bpe_tokenizer() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 8, trainer)
    s = PromptSynth(16, seed=2)
    prefix = s.text([1, 2, 3], 48)
    for tail in ([4], [9, 10]):
        full = s.text([1, 2, 3, *tail], 48 + 16 * len(tail))
        ids_prefix = tok.encode(prefix).ids
        ids_full = tok.encode(full).ids
        # the shared blocks' text tokenizes to the same leading tokens in every prompt
        assert ids_full[: len(ids_prefix)] == ids_prefix
        # a vocabulary trained on the word list keeps one token per word
        assert len(ids_full) == count_words(full)
