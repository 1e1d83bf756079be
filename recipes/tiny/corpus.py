"""Build the four-domain corpus (raw text + ChatML conversations) and the drafter prompt sets.

Output under <out>/corpus/: `{domain}.{kind}.{split}.txt` with documents joined by
`<|endoftext|>` (kind: raw | chat, split: train | val), plus `stats.json`. Documents are
grouped into ~32 KB chunks in order; every 50th chunk goes to validation.
"""

import json
import random
from pathlib import Path

import chatgen
import mathgen
import sources

DOMAINS = ("code", "prose", "docs", "math")
EOT = "<|endoftext|>"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHUNK_BYTES = 32_000
VAL_EVERY = 50
# characters of generated ChatML per domain
CHAT_CHARS = {"math": 3_000_000, "code": 5_000_000, "docs": 4_000_000, "prose": 3_000_000}
MATH_RAW_CHARS = 3_000_000
PROMPTS = {"train": 1000, "heldout": 100}  # per domain


def _strip_specials(text: str) -> str:
    for s in SPECIALS:
        text = text.replace(s, "")
    return text


def raw_documents(stdlib: list, pools: chatgen.Pools, rng: random.Random) -> dict[str, list[str]]:
    """Plain-text documents per domain, in source order."""
    prose = ([chapter for novel in sources.austen_novels() for chapter in novel]
             + [name + "\n\n" + "\n".join(f"{i + 1} {v}" for i, v in enumerate(verses))
                for name, verses in pools.kjv]
             + pools.fortunes)
    docs = ([text for _, text in pools.manual] + list(pools.topics.values())
            + [f"{term}\n\n{body}" for term, body in pools.jargon]
            + sources.debian_texts() + [text for _, text in pools.gnu])
    math, size = [], 0
    while size < MATH_RAW_CHARS:
        math.append(mathgen.raw_text(rng))
        size += len(math[-1])
    out = {"code": [text for _, text in stdlib], "prose": prose, "docs": docs, "math": math}
    return {k: [_strip_specials(d) for d in v] for k, v in out.items()}


def chat_documents(pools: chatgen.Pools, rng: random.Random) -> dict[str, list[str]]:
    """Rendered ChatML conversations per domain, CHAT_CHARS characters each."""
    out = {}
    for domain in DOMAINS:
        docs, size = [], 0
        while size < CHAT_CHARS[domain]:
            docs.append(chatgen.render(chatgen.BUILDERS[domain](rng, pools)))
            size += len(docs[-1])
        out[domain] = docs
    return out


def split_chunks(docs: list[str]) -> tuple[list[str], list[str]]:
    """Group documents into ~CHUNK_BYTES chunks; every VAL_EVERY-th chunk is validation."""
    train, val, chunk, size, index = [], [], [], 0, 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_BYTES:
            (val if index % VAL_EVERY == VAL_EVERY - 1 else train).extend(chunk)
            chunk, size, index = [], 0, index + 1
    train.extend(chunk)
    return train, val


def write_prompts(pools: chatgen.Pools, out: Path, seed: int) -> dict[str, int]:
    """prompts-train.jsonl / prompts-heldout.jsonl: {"turns": [...]} user turns per line."""
    seen, counts = set(), {}
    for split, offset in (("train", 1), ("heldout", 2)):
        rng, lines = random.Random(seed * 1000 + offset), []
        for domain in DOMAINS:
            n, tries = 0, 0
            while n < PROMPTS[split] and tries < 50 * PROMPTS[split]:
                tries += 1
                turns = chatgen.user_turns(chatgen.BUILDERS[domain](rng, pools))
                key = json.dumps(turns)
                if key in seen:
                    continue
                seen.add(key)
                lines.append(json.dumps({"turns": turns, "domain": domain}, ensure_ascii=False))
                n += 1
        rng.shuffle(lines)
        (out / f"prompts-{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts[split] = len(lines)
    return counts


def build(out: Path, seed: int, install_packages: bool = False) -> dict:
    """Write the corpus and prompt files under `out`; return statistics. The Debian text packages
    are installed (apt-get) only with ``install_packages``."""
    sources.install_packages(install_packages)
    rng = random.Random(seed)
    stdlib = sources.stdlib_files()
    pools = chatgen.Pools.load(stdlib)
    corpus_dir = out / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    stats = {"seed": seed, "streams": {}}
    streams = {"raw": raw_documents(stdlib, pools, rng), "chat": chat_documents(pools, rng)}
    for kind, per_domain in streams.items():
        for domain, docs in per_domain.items():
            train, val = split_chunks(docs)
            for split, part in (("train", train), ("val", val)):
                path = corpus_dir / f"{domain}.{kind}.{split}.txt"
                path.write_text(EOT.join(part), encoding="utf-8")
                stats["streams"][f"{domain}.{kind}.{split}"] = {
                    "documents": len(part), "chars": sum(map(len, part))}
    stats["prompts"] = write_prompts(pools, out, seed)
    (corpus_dir / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats
