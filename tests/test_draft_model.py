"""``draft-model`` pairs a draft LM and a target whose tokenizers agree, whatever rows their
embedding tables are padded to (the draft's logits are cut or extended to the target's rows),
and refuses only models whose tokenizers differ."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    VOCAB_SIZE,
    _special_ids,
    assert_cli_error,
    run_cli,
    tiny_tokenizer,
)
from transformers import AutoModelForCausalLM, Qwen3Config

from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.testing import check_engine_lossless

PADDED = VOCAB_SIZE + 16  # embedding rows past the tokenizer's ids, as real checkpoints pad them


def lm(vocab: int, seed: int) -> Target:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=True, **_special_ids())
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    return Target(model, tiny_tokenizer())


def draft_model(target: Target, draft: Target, block_size: int = 3):
    cls = get_drafter_class("draft-model")
    return cls(cls.config_class(block_size=block_size), target, model=draft)


@pytest.mark.parametrize("target_rows, draft_rows", [(PADDED, VOCAB_SIZE), (VOCAB_SIZE, PADDED)],
                         ids=["target-padded", "draft-padded"])
def test_padded_vocabularies_pair_losslessly(target_rows, draft_rows):
    target, draft = lm(target_rows, 0), lm(draft_rows, 1)
    drafter = draft_model(target, draft)
    prompts = [target.render_prompt("The quick brown fox")]
    greedy = GenerationConfig(max_new_tokens=12, temperature=0.0, block_size=3)
    got = SpeculativeEngine(target, drafter, greedy, stop_ids=[]).generate(prompts)[0].output_ids
    want = target.model.generate(torch.tensor(prompts), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompts[0]):].tolist()
    assert got == want
    results = check_engine_lossless(target, drafter, prompts, per_prompt=3000, max_batch=3000,
                                    sampling={"temperature": 1.0}, name="padded draft-model")
    assert sum(sum(r.accepted) for r in results) > 0  # drafts were accepted, so q was on the target's rows


def test_different_tokenizers_are_refused():
    target, draft = lm(VOCAB_SIZE, 0), lm(VOCAB_SIZE, 1)
    draft.tokenizer = tiny_tokenizer()
    draft.tokenizer.add_tokens(["<|extra|>"])  # one id more: ids may no longer mean the same text
    with pytest.raises(DspecError, match="tokenizer differs from the target's"):
        draft_model(target, draft)
    small = lm(VOCAB_SIZE - 8, 1)
    with pytest.raises(DspecError, match=f"embeds {VOCAB_SIZE - 8} token ids, fewer than its tokenizer's"):
        draft_model(target, small)


def test_cli_pairs_a_padded_draft(model_dir, tmp_path, capsys):
    folder = tmp_path / "draft"
    model = lm(PADDED, 1)
    model.model.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    code, _, err = run_cli(["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint",
                            str(folder), "--num-prompts", "1", "--max-new-tokens", "4", "--block-size", "3"], capsys)
    assert code == 0, err
    other = tmp_path / "other"
    tok = tiny_tokenizer()
    tok.add_tokens(["<|extra|>"])
    model.model.save_pretrained(other)
    tok.save_pretrained(other)
    assert_cli_error(["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(other),
                      "--num-prompts", "1"], capsys, "draft model tokenizer differs from the target's tokenizer")
