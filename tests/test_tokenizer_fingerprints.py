"""Tokenizers held by a transform are described by their own serialized model
(pipeline/identity/fingerprint.py: tokenizer_model): tokenizers, transformers and sentencepiece,
each built here by its own library from in-memory text."""

from __future__ import annotations

import io

import numpy as np
import pytest

import quern

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "packing documents into rows of tokens",
    "a data pipeline for jax training on many hosts",
    "every batch is a pure function of the step",
] * 20


def _docs():
    return quern.Pipeline.from_source({"text": np.asarray(TEXT[:8])}, seed=0)


def _hf_tokenizer(words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in sorted({w for line in TEXT for w in line.split()})[:words]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


def _tokenize_with(tok):
    def tokenize(record):
        return np.asarray(tok.encode(str(record["text"])).ids, dtype=np.int32)

    return tokenize


def test_a_tokenizers_tokenizer_needs_no_fingerprint_method_and_its_vocabulary_counts():
    a, same, other = _hf_tokenizer(20), _hf_tokenizer(20), _hf_tokenizer(10)
    pipes = [_docs().map(_tokenize_with(t)).batch(1) for t in (a, same, other)]
    assert pipes[0].fingerprint() == pipes[1].fingerprint() != pipes[2].fingerprint()
    assert pipes[0].batch_at(0).tolist()[0][0] == 1  # <s> first: the tokenizer runs
    bound = _docs().map(a.encode_batch).fingerprint()  # a builtin method: described by its tokenizer too
    assert bound != _docs().map(other.encode_batch).fingerprint()


def test_a_transformers_fast_tokenizer_is_described_by_its_backend_and_special_tokens():
    from transformers import PreTrainedTokenizerFast

    def wrap(words, eos):
        return PreTrainedTokenizerFast(tokenizer_object=_hf_tokenizer(words), bos_token="<s>", eos_token=eos)

    def encode_with(tok):
        def encode(record):
            return np.asarray(tok(str(record["text"]))["input_ids"], dtype=np.int32)

        return encode

    prints = [_docs().map(encode_with(wrap(w, e))).fingerprint() for w, e in [(20, "</s>"), (20, "</s>"), (10, "</s>")]]
    assert prints[0] == prints[1] != prints[2]
    assert _docs().map(encode_with(wrap(20, "[UNK]"))).fingerprint() != prints[0]  # another special token


def _sentencepiece(vocab_size: int):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=vocab_size, minloglevel=2, hard_vocab_limit=False
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def test_a_sentencepiece_processor_is_described_by_its_model_proto():
    a, other = _sentencepiece(40), _sentencepiece(30)
    same = __import__("sentencepiece").SentencePieceProcessor(model_proto=a.serialized_model_proto())

    def encode_with(sp):
        def encode(record):
            return np.asarray([sp.bos_id(), *sp.encode(str(record["text"])), sp.eos_id()], dtype=np.int32)

        return encode

    prints = [_docs().map(encode_with(sp)).fingerprint() for sp in (a, same, other)]
    assert prints[0] == prints[1] != prints[2]


def test_other_library_objects_are_still_refused():
    import threading

    lock = threading.Lock()

    def uses_lock(record):
        with lock:
            return record

    with pytest.raises(quern.FingerprintError, match="cannot describe by its content"):
        _docs().map(uses_lock).fingerprint()
