"""Byte-level BPE tokenizer (vocab 8192) and corpus encoding to uint16 arrays."""

import json
from pathlib import Path

import numpy as np
from corpus import EOT, SPECIALS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 8192


def _train_texts(corpus_dir: Path):
    """Training-split documents with the special-token strings removed."""
    for path in sorted(corpus_dir.glob("*.train.txt")):
        for doc in path.read_text(encoding="utf-8").split(EOT):
            for s in SPECIALS:
                doc = doc.replace(s, "\n")
            yield doc


def train_tokenizer(corpus_dir: Path, out_file: Path, vocab: int = VOCAB) -> Tokenizer:
    """Train on the training split only; special tokens get ids 0..3 in SPECIALS order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_train_texts(corpus_dir), trainer=trainer)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_file))
    return tok


def encode_corpus(tok: Tokenizer, corpus_dir: Path, data_dir: Path) -> dict:
    """Encode every `{domain}.{kind}.{split}.txt` to `data_dir/<same>.npy` (uint16, EOT after
    each document); return token and byte counts per stream."""
    data_dir.mkdir(parents=True, exist_ok=True)
    eot = tok.token_to_id(EOT)
    stats = {}
    for path in sorted(corpus_dir.glob("*.txt")):
        docs = path.read_text(encoding="utf-8").split(EOT)
        ids = [np.asarray(e.ids + [eot], dtype=np.uint16) for e in tok.encode_batch(docs)]
        arr = np.concatenate(ids) if ids else np.zeros(0, np.uint16)
        np.save(data_dir / f"{path.stem}.npy", arr)
        n_bytes = sum(len(d.encode("utf-8")) for d in docs)
        stats[path.stem] = {"tokens": int(arr.size), "bytes": n_bytes,
                            "bytes_per_token": round(n_bytes / max(arr.size, 1), 3)}
    (data_dir / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats

