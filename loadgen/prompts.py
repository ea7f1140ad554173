"""Deterministic prompt synthesis from trace hash ids.

Every hash id maps to one fixed block of ``block_size`` token ids (a seeded splitmix64 of
``(seed, hash_id, position)``), so two synthesized prompts share exactly the leading blocks their
``hash_ids`` share, and nothing else. A prompt of ``input_length`` tokens is the concatenation of
its blocks with the last one cut to ``input_length - (len(hash_ids) - 1) * block_size`` tokens.

Text mode (for ``--api chat``) renders each token id as one word from a fixed list, each with a
leading space. Tokenizers split text into words at spaces before merging, so a word's tokens do
not depend on its neighbours: the text of a shared block tokenizes identically in every prompt
(stable tokenization), and common words are one token in most LLM vocabularies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachemap.hashing import GOLDEN, mix64_finish

DEFAULT_VOCAB_SIZE = 30_000
# NOTE: low ids hold special and byte tokens in most vocabularies; stay clear of them.
DEFAULT_TOKEN_OFFSET = 1_000

_GOLDEN = np.uint64(GOLDEN)

# Common English words that are single tokens in GPT-2/Llama/Qwen-style BPE vocabularies.
_WORD_TEXT = """the of and to in is was for on that with as by at from his her are be this
    have an not
    they which one had were all their there been has more also new when who can some other time
    into only after these two would first over most such them then than its may about out made
    many before where both between under well used life known being while since during each
    world people state family work city year through very three water group part place same
    found last area long high four small number name way house school line end book game war
    music left another power back land early system public white death field black order water
    king town park south north east west light church space river court party team paper view
    sea air fire story road river hand head body heart mind word point rule plan case fact door
    room wall table chair glass stone gold iron wood tree leaf seed rain snow wind cloud star
    moon sun day night week month hour minute second color green blue red brown gray young old
    good great little big large short full open free clear simple strong quick slow warm cold
    dark bright soft hard clean fresh rich poor happy safe true real sure ready able late near
    far low deep wide thin thick heavy light final major minor local main best next cost price
    value money bank trade market store shop street bridge train ship car plane bus bike horse
    dog cat bird fish animal plant flower garden farm food bread milk tea coffee fruit apple
    sugar salt oil meat egg rice corn salad soup dinner lunch breakfast cook kitchen bed window
    floor roof gate fence path track trail hill valley island lake ocean coast beach desert"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


class PromptSynth:
    """Maps trace hash ids to token ids (and words) deterministically.

    ``block_size`` is the trace's tokens per hash id (512 Mooncake, 16 Bailian); token ids lie
    in ``[token_offset, token_offset + vocab_size)``. Equal ``(seed, block_size, vocab_size,
    token_offset)`` give equal prompts in every process.
    """

    __slots__ = ("_pos", "_seed", "block_size", "token_offset", "vocab_size")

    def __init__(
        self,
        block_size: int,
        seed: int = 0,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        token_offset: int = DEFAULT_TOKEN_OFFSET,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        if token_offset < 0:
            raise ValueError(f"token_offset must be >= 0, got {token_offset}")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.token_offset = token_offset
        self._seed = mix64_finish(np.array([seed & (2**64 - 1)], dtype=np.uint64))[0]
        self._pos = np.arange(block_size, dtype=np.uint64) * _GOLDEN

    def blocks(self, hash_ids: Sequence[int]) -> np.ndarray:
        """Token ids of whole blocks, shape ``(len(hash_ids), block_size)``, dtype int64."""
        ids = np.asarray(hash_ids, dtype=np.uint64).reshape(-1)
        base = mix64_finish(ids ^ self._seed)
        z = mix64_finish(base[:, None] + self._pos[None, :])
        return (z % np.uint64(self.vocab_size)).astype(np.int64) + self.token_offset

    def token_ids(self, hash_ids: Sequence[int], input_length: int) -> np.ndarray:
        """The prompt of one trace request: its blocks, the last one cut to length."""
        n = len(hash_ids)
        if input_length <= 0:
            raise ValueError(f"input_length must be > 0, got {input_length}")
        if not (n - 1) * self.block_size < input_length <= n * self.block_size:
            raise ValueError(
                f"input_length {input_length} does not fit {n} blocks of {self.block_size}"
            )
        return self.blocks(hash_ids).reshape(-1)[:input_length]

    def words(self, token_ids: np.ndarray | Sequence[int]) -> str:
        """Text rendering: one word per token id, each with a leading space."""
        idx = np.asarray(token_ids, dtype=np.int64) % len(WORDS)
        return "".join(_SPACED[i] for i in idx.tolist())

    def text(self, hash_ids: Sequence[int], input_length: int) -> str:
        return self.words(self.token_ids(hash_ids, input_length))


_SPACED: tuple[str, ...] = tuple(" " + w for w in WORDS)


def count_words(text: str) -> int:
    """Token count of a text prompt under the word rendering (what the null server reports)."""
    return len(text.split())
