"""Runs in the engine environment (``tests/vllm_server.py``): vllm-project/speculators, an
independent implementation of DFlash, DSpark and EAGLE-3, loads dspec's exports and recomputes
dspec's drafts.

    python speculators_check.py CASES.json RESULT.json

CASES.json lists, per drafter: ``speculators`` (a ``dspec export --format speculators`` folder),
optionally ``engine`` and ``engine_layout`` (the vLLM / SGLang export of the same drafter), and
``inputs`` (safetensors written by dspec: the prompt ``ids`` [L] whose last token is the anchor,
the target's ``taps`` [L, n·d] at the drafter's layers, dspec's ``drafts`` [γ] and, per draft slot,
the ``logits`` [γ, V] dspec drew it from and the raw ``confidence`` [γ] when it has a head).

Per drafter it reports: the tensors of each folder that speculators' model does not have
(``unexpected``) and the ones it needs that the folder lacks, verifier-owned ones aside
(``missing``); whether the engine layout holds the same weights (converted by speculators' own
converter where it has one: z-lab DFlash, EAGLE-3; DeepSpec's DSpark names are speculators' own);
and speculators' logits / confidences for dspec's inputs (the block teacher-forced with dspec's
drafts), computed in float32 by the model speculators' loader built.
"""

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                  "t2d", "d2t"}


def load(folder: str):
    """speculators' own loader, attention in eager mode (flex attention needs a compiler on a CPU)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=config, dtype=torch.float32)
    return model.eval()


def key_diff(model, tensors: dict) -> dict:
    own = set(model.state_dict())
    return {"missing": sorted(own - set(tensors) - VERIFIER_OWNED), "unexpected": sorted(set(tensors) - own)}


def engine_weights(case: dict, model) -> dict:
    """The engine export's weights in speculators' names (converted by speculators where it can)."""
    folder, layout = case["engine"], case["engine_layout"]
    if layout == "DFlashDraftModel":
        from speculators.convert.dflash.converter import DFlashConverter

        with tempfile.TemporaryDirectory() as out:
            DFlashConverter().convert(folder, out, base_model=case["target"], validate=False)
            return load_file(str(Path(out) / "model.safetensors"))
    if layout == "LlamaForCausalLMEagle3":
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter

        aux = json.loads((Path(folder) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        with tempfile.TemporaryDirectory() as out:
            Eagle3Converter().convert(folder, out, base_model=case["target"], validate=False,
                                      eagle_aux_hidden_state_layer_ids=aux)
            return load_file(str(Path(out) / "model.safetensors"))
    return load_file(str(Path(folder) / "model.safetensors"))  # DeepSpec: speculators' names


def without_identity_maps(model, tensors: dict) -> dict:
    """The engine layout's vocabulary maps of a full vocabulary (d2t all zero, t2d all true) are
    identities a full-vocabulary speculators model has no buffers for."""
    identity = getattr(model, "d2t", None) is None and not tensors.get("d2t", torch.zeros(1)).any() \
        and bool(tensors.get("t2d", torch.ones(1, dtype=torch.bool)).all())
    return {k: v for k, v in tensors.items() if not (identity and k in ("d2t", "t2d"))}


def same_weights(model, tensors: dict) -> list[str]:
    """Names whose values differ from the model's (as loaded from the speculators folder)."""
    own = model.state_dict()
    return sorted(k for k, v in tensors.items() if k in own and k not in VERIFIER_OWNED
                  and not torch.equal(v.float(), own[k].float()))


def block_outputs(model, inputs: dict, skip: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits [γ, V] and raw confidences [γ] of the block at the anchor (the last prompt
    token), teacher-forced with dspec's drafts, through the model's own training forward; draft
    slot k is block slot k + ``skip`` (1 in z-lab's block, whose anchor slot predicts nothing)."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    ids, taps, drafts = inputs["ids"].long(), inputs["taps"].float(), inputs["drafts"].long()
    cfg = model.config
    block, anchor = cfg.block_size, ids.numel() - 1
    seq = torch.cat([ids, drafts[: block - 1], torch.zeros(block + 1, dtype=torch.long)])[None]  # [1, T]
    T = seq.shape[1]
    hidden = torch.zeros(1, T, taps.shape[-1])
    hidden[0, :anchor] = taps[:anchor]  # the context's taps; the block attends to positions < anchor
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchor] = 1
    seen = {}

    def dflash_metrics(logits, *_args, **_kw):  # (logits, targets, loss_mask, block_size, ...)
        seen["logits"] = logits
        return torch.zeros(()), {}

    def dspark_metrics(logits, _targets, confidence_logits, *_args, **_kw):
        seen["confidence"] = confidence_logits
        return dflash_metrics(logits)

    dflash_core.compute_metrics, dspark_core.compute_metrics = dflash_metrics, dspark_metrics
    last = torch.zeros(1, T, cfg.transformer_layer_config.hidden_size)  # the verifier's (only for the loss)
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=seq, loss_mask=loss_mask, verifier_last_hidden_states=last,
              document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=1)
    gamma = drafts.numel()
    logits = seen["logits"][0, skip: skip + gamma]
    conf = seen.get("confidence")
    return logits, None if conf is None else conf[0, skip: skip + gamma]


def eagle3_outputs(model, inputs: dict) -> torch.Tensor:
    """Draft logits [γ, V] of the chain after the anchor: training-time-test steps teacher-forced
    with dspec's drafts, read at the anchor's position (EAGLE-3 pairs token x_{t+1} with the
    target's features at t, so the inputs are shifted by one as speculators' data pipeline does)."""
    ids, taps, drafts = inputs["ids"].long(), inputs["taps"].float(), inputs["drafts"].long()
    gamma, n = drafts.numel(), ids.numel()
    seq = torch.cat([ids, drafts[: gamma - 1]])  # [n + γ − 1]
    hidden = torch.zeros(seq.numel() - 1, taps.shape[-1])
    hidden[: n - 1] = taps[: n - 1]
    steps = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: steps.append(out[0, n - 2].clone()))
    with torch.no_grad():
        model(hidden_states=hidden[None], input_ids=seq[1:][None],
              document_ids=torch.zeros(1, seq.numel() - 1, dtype=torch.long), ttt_steps=gamma)
    hook.remove()
    logits = torch.stack(steps)  # [γ, N]
    if getattr(model, "d2t", None) is not None:  # reduced draft vocabulary: scatter to target ids
        full = torch.full((gamma, model.config.transformer_layer_config.vocab_size), float("-inf"))
        full[:, torch.arange(logits.shape[1]) + model.d2t] = logits
        logits = full
    return logits


def outputs(model, kind: str, inputs: dict, skip: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (eagle3_outputs(model, inputs), None) if kind == "eagle3" else block_outputs(model, inputs, skip)


@contextmanager
def flipped(model, kind: str, skip: int):
    """The model read with the one convention its format's readers default differently flipped:
    ``norm_before_residual`` for EAGLE-3; ``sample_from_anchor`` for the block drafters, which moves
    DSpark's Markov inputs by one slot and, for DFlash, which slot predicts. Yields (name, skip)."""
    if kind == "eagle3":
        layer = model.layers[0]
        layer.norm_before_residual = not layer.norm_before_residual
        yield "norm_before_residual", skip
        layer.norm_before_residual = not layer.norm_before_residual
    elif type(model).__name__ == "DFlashDraftModel":  # no Markov head: the flag only moves the slots
        yield "sample_from_anchor", 1 - skip
    else:
        model.config.sample_from_anchor = not model.config.sample_from_anchor
        yield "sample_from_anchor", skip
        model.config.sample_from_anchor = not model.config.sample_from_anchor


def check(case: dict) -> dict:
    model = load(case["speculators"])
    out = {"speculators": key_diff(model, load_file(str(Path(case["speculators"]) / "model.safetensors"))),
           "class": type(model).__name__}
    if case.get("engine"):
        weights = without_identity_maps(model, engine_weights(case, model))
        out["engine"] = {**key_diff(model, weights), "differ": same_weights(model, weights)}
    inputs = load_file(case["inputs"])
    skip = 0 if getattr(model.config, "sample_from_anchor", True) else 1  # as the folder says
    logits, conf = outputs(model, case["kind"], inputs, skip)
    ours = inputs["logits"].float()
    with flipped(model, case["kind"], skip) as (convention, wrong_skip):  # readers' defaults disagree on it
        wrong, _ = outputs(model, case["kind"], inputs, wrong_skip)
    out["flipped"] = convention
    out["flipped_max_abs_diff"] = float((wrong - ours)[torch.isfinite(ours)].abs().max())
    finite = torch.isfinite(ours)
    out["logits_max_abs_diff"] = float((logits - ours)[finite].abs().max())
    out["logits_scale"] = float(ours[finite].abs().max())
    out["same_argmax"] = bool(torch.equal(logits.argmax(-1), ours.argmax(-1)))
    if "confidence" in inputs:
        out["confidence_max_abs_diff"] = None if conf is None else float((torch.sigmoid(conf) - inputs["confidence"]).abs().max())
    return out


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps({name: check(case) for name, case in cases.items()}, indent=2))
