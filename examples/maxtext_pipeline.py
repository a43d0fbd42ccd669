"""MaxText's grain pretrain and eval pipelines, step by step, in quern.

MaxText (``input_pipeline/_grain_data_processing.py``) reads ArrayRecord files of
``tf.train.Example`` protos, tokenizes their ``text`` with BOS and EOS, cuts long
documents (``TokenizeAndChunk``), packs ``inputs`` and ``targets`` with grain's
first-fit packer, shifts the inputs right, batches per host and assembles global
arrays; eval pads its last batch; training data may be a mixture. Here the same steps:

1. Writes two small corpora ("web" and "code") and an eval split, each an ArrayRecord
   file of serialized ``tf.train.Example`` protos, and trains a word-level
   ``tokenizers`` tokenizer on them (everything local, nothing downloaded).
2. Pretrain: per corpus ``shuffle -> parse -> tokenize (BOS/EOS) -> flat_map(chunk) ->
   pack(first_fit, inputs + targets) `` and ``quern.mix`` of the two by weight, batched
   (global batch 16), inputs shifted right, as ``jax.Array`` global batches.
3. Trains 3 steps, saves model and data state with orbax, restores them as a restarted
   job would, resumes at step 3 and checks the batches against ``batch_at``, and that 2
   hosts would get the same global batches.
4. Eval: the eval split once, packed, with its last batch padded (``valid``), so every
   host has every step.

Run:  python examples/maxtext_pipeline.py  [--out DIR] [--docs 400]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import quern

SEQ_LEN = 64  # max_target_length
BATCH = 16  # global_batch_size_to_load
PAD, BOS, EOS = 0, 1, 2
WORDS = {
    "web": "the a of to and in is was for on that with as by at from it this be are have".split(),
    "code": "def return if else for in while import class self none true false try except with as pass".split(),
}


def write_corpus(path: str, kind: str, n: int, seed: int) -> list[str]:
    """``n`` documents of 5..150 words of ``kind``, as tf.train.Example protos in an ArrayRecord file."""
    from array_record.python import array_record_module
    from tfrecord import example_pb2

    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS[kind], int(rng.integers(5, 150)))) for _ in range(n)]
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for text in texts:
        example = example_pb2.Example()
        example.features.feature["text"].bytes_list.value.append(text.encode())
        writer.write(example.SerializeToString())
    writer.close()
    return texts


def train_tokenizer(texts: list[str]):
    """A word-level tokenizer with ``<pad>``, ``<s>`` and ``</s>``, adding BOS and EOS to every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    for word in sorted({w for t in texts for w in t.split()}):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", BOS), ("</s>", EOS)]
    )
    return tok


def parse_example(raw: bytes) -> dict:
    """MaxText's ``ParseFeatures``: the ``text`` feature of a serialized ``tf.train.Example``."""
    from tfrecord import example_pb2

    return {"text": example_pb2.Example.FromString(raw).features.feature["text"].bytes_list.value[0].decode()}


class Tokenize:
    """MaxText's ``Tokenize`` (with BOS/EOS): ``inputs`` and ``targets``, the same ids (shifted later)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # described by its serialized model in the fingerprint

    def __call__(self, record: dict) -> dict:
        ids = np.asarray(self.tokenizer.encode(record["text"]).ids, dtype=np.int32)
        return {"inputs": ids, "targets": ids}


def chunk(record: dict, size: int = SEQ_LEN) -> list[dict]:
    """MaxText's ``TokenizeAndChunk``: a document of more than ``size`` tokens cut into several."""
    n = len(record["inputs"])
    return [{k: v[i : i + size] for k, v in record.items()} for i in range(0, n, size)]


def shift_inputs(batch: dict) -> dict:
    """MaxText's ``ShiftData``: inputs shifted right by one (``PAD`` first) inside each packed document."""
    out = dict(batch)
    inputs = np.full_like(batch["inputs"], PAD)
    inputs[:, 1:] = batch["inputs"][:, :-1]
    inputs[batch["inputs_positions"] == 0] = PAD  # a document's first token has nothing before it
    out["inputs"] = inputs
    return out


def documents(folder: str, name: str, tokenizer, seed: int, num_epochs: int | None = None) -> quern.Pipeline:
    """Parsed, tokenized and chunked documents of one ArrayRecord file."""
    src = quern.sources.ArrayRecordSource(os.path.join(folder, f"{name}.array_record"), name=name)
    pipe = quern.Pipeline.from_source(src, seed=seed, num_epochs=num_epochs)
    if num_epochs is None:
        pipe = pipe.shuffle()
    return pipe.map(parse_example).map(Tokenize(tokenizer)).flat_map(chunk)


def packed(pipe: quern.Pipeline) -> quern.Pipeline:
    """grain's ``FirstFitPackIterDataset(length_struct={inputs, targets}, num_packing_bins=BATCH)``."""
    return pipe.pack({"inputs": SEQ_LEN, "targets": SEQ_LEN}, mode="first_fit", num_bins=BATCH, pad_value=PAD)


def pretrain(folder: str, tokenizer) -> quern.Pipeline:
    """The training pipeline: a 70/30 mixture of the two corpora, packed, batched, shifted."""
    components = {name: packed(documents(folder, name, tokenizer, seed=i)) for i, name in enumerate(("web", "code"))}
    return quern.mix(components, weights={"web": 0.7, "code": 0.3}, seed=0).batch(BATCH).map_batch(shift_inputs)


def evaluation(folder: str, tokenizer) -> quern.Pipeline:
    """The eval pipeline: the eval split once, packed, its last batch padded (``valid``)."""
    pipe = packed(documents(folder, "eval", tokenizer, seed=0, num_epochs=1))
    return pipe.batch(BATCH, drop_remainder=False, pad_remainder=True, pad_value=PAD).map_batch(shift_inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="a folder for the data and the checkpoint (default: a temporary one)"
    )
    parser.add_argument("--docs", type=int, default=400, help="documents per corpus")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or tmp
        os.makedirs(folder, exist_ok=True)
        texts = []
        for i, (name, kind) in enumerate((("web", "web"), ("code", "code"), ("eval", "web"))):
            texts += write_corpus(os.path.join(folder, f"{name}.array_record"), kind, args.docs, seed=i)
        tokenizer = train_tokenizer(texts)
        run(folder, tokenizer)


def run(folder: str, tokenizer) -> None:
    import orbax.checkpoint as ocp

    from quern.sharding.checkpoint import QuernRestore, QuernSave

    train = pretrain(folder, tokenizer)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step_fn = jax.jit(lambda params, b: {"tokens": params["tokens"] + jnp.sum(b["targets_segment_ids"] > 0)})
    params = jax.device_put({"tokens": jnp.zeros((), jnp.int32)}, replicated)
    mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(folder, "ckpt")))
    with quern.sharding.global_iterator(train, mesh) as it:
        first = next(it)
        print("batch:", {k: tuple(v.shape) for k, v in sorted(first.items())})
        params = step_fn(params, first)
        for _ in range(2):
            params = step_fn(params, next(it))
        mngr.save(it.step, args=ocp.args.Composite(model=ocp.args.StandardSave(params), data=QuernSave(it)))
    mngr.wait_until_finished()
    real = float(np.mean(np.asarray(first["targets_segment_ids"]) > 0))
    print(f"fill of step 0: {real:.3f} of the tokens are data")

    # a restarted job: everything built again, model and data state restored
    again = pretrain(folder, tokenizer)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)
    restored = mngr.restore(
        mngr.latest_step(), args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract), data=QuernRestore(again))
    )
    step = restored.data["step"]
    with quern.sharding.global_iterator(again, mesh, start_step=step) as it:
        same = all(
            all(np.array_equal(np.asarray(v), again.batch_at(step + i)[k]) for k, v in next(it).items())
            for i in range(3)
        )
    print(f"resumed at step {step}: the next 3 batches equal batch_at: {same}")
    hosts = all(
        all(
            np.array_equal(np.concatenate([again.batch_at(s, h, 2)[k] for h in range(2)]), v)
            for k, v in again.batch_at(s).items()
        )
        for s in range(4)
    )
    print(f"on 2 hosts the global batches are the same: {hosts}")

    ev = evaluation(folder, tokenizer)
    last = ev.batch_at(ev.num_steps - 1)
    halves = [ev.batch_at(ev.num_steps - 1, h, 2) for h in range(2)]
    print(
        f"eval: {ev.num_steps} steps of {BATCH} rows; the last has {int(last['valid'].sum())} real rows, "
        f"each of 2 hosts gets {[len(h['valid']) for h in halves]} rows"
    )
    with quern.sharding.global_iterator(ev, mesh) as it:
        counted = sum(int(np.asarray(b["valid"]).sum()) for b in it)
    print(f"eval rows through global arrays: {counted} (packed rows of the split: {ev.stream.length()})")


if __name__ == "__main__":
    main()
