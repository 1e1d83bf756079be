"""dspec's exports against an independent implementation: vllm-project/speculators (pinned, in the
engine environment of ``tests/vllm_server.py``), whose DFlash, DSpark and EAGLE-3 models are not
dspec's code.

For every shipped drafter: ``dspec export --format speculators`` loads through speculators' own
loader (``SpeculatorModel.from_pretrained``) with no unexpected tensor and none missing but those
speculators takes from the target; the engine export (vLLM's layout, SGLang's for dspark-rnn, which
only SGLang serves) holds the same weights under speculators' names (through speculators' own
converters for z-lab DFlash and EAGLE-3); and, fed the same target features and anchor with the
block teacher-forced by dspec's drafts, speculators' model gives dspec's draft logits (same argmax at
every slot, within bf16 precision of the largest logit; both sides compute in float32 from the same
bf16 weights) and confidences, while flipping the convention whose default the readers disagree on
(``sample_from_anchor``, ``norm_before_residual``) moves the logits far outside that tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from test_interop import ArgmaxSampler
from tiny_models import full_forward
from vllm_server import run_engine_script, vllm_env

from dspec_cli.checkpoints.loading import load_drafter
from dspec_cli.core.files import DEFAULT_TARGET_PATH
from dspec_cli.runtime.target import Target

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

GAMMA = 7
PROMPT = "A farmer has 3 fields with 42 sheep each. He sells 19 sheep. How many sheep are left?"
ENGINE_FORMAT = {"dflash": "vllm", "dspark-markov": "vllm", "dspark-rnn": "sglang", "eagle3": "vllm"}
BF16 = 2.0**-7  # relative precision of bfloat16


class RecordingSampler(ArgmaxSampler):
    """Argmax drafts, recording the logits each draft slot is drawn from."""

    def __init__(self):
        self.logits = []

    def probs(self, logits):
        self.logits.append(logits.float().clone())
        return super().probs(logits)


def dspec_inputs(name: str, target: Target, path) -> str:
    """The target's taps of a prompt, and dspec's drafts, logits and confidences after it (its last
    token as the anchor), saved for the engine side."""
    drafter = load_drafter(name, target, None, GAMMA)
    ids = torch.tensor(target.render_prompt(PROMPT))
    _, taps = full_forward(target, ids[None], drafter.target_layer_ids)  # [L, n·d]
    state = drafter.init_state()
    drafter.add_requests(state, [ids[:-1]], [taps[:-1]])
    sampler = RecordingSampler()
    out = drafter.propose(state, ids[-1:], GAMMA, sampler)
    logits = torch.cat(sampler.logits)  # [γ, V]: one call per slot (DSpark, EAGLE-3) or one for the block (DFlash)
    tensors = {"ids": ids, "taps": taps.float().contiguous(), "drafts": out.tokens[0], "logits": logits.contiguous()}
    if out.confidence is not None:
        tensors["confidence"] = out.confidence[0].float().contiguous()
    save_file(tensors, str(path))
    return str(path)


def export(name: str, fmt: str, out) -> dict | None:
    """``dspec export`` as a user runs it: the report, or None when the drafter has no such export."""
    report = out.with_suffix(".json")
    done = subprocess.run([sys.executable, "-m", "dspec_cli", "export", str(DEFAULT_TARGET_PATH.parent / "drafters" / name),
                           "--format", fmt, "--output", str(out), "--dtype", "bfloat16", "--json", str(report)],
                          capture_output=True, text=True)
    if done.returncode != 0 and fmt != "speculators" and len(done.stderr.strip().splitlines()) == 1:
        return None  # a one-line refusal (e.g. eagle3 with q/k norms for vLLM)
    assert done.returncode == 0, done.stderr
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    engine_dir = vllm_env()
    root = tmp_path_factory.mktemp("speculators")
    target = Target.load(None, dtype="float32")
    cases = {}
    for name, fmt in ENGINE_FORMAT.items():
        spec = export(name, "speculators", root / f"{name}-speculators")
        assert spec is not None
        engine = export(name, fmt, root / f"{name}-{fmt}")
        cases[name] = {"kind": "eagle3" if name == "eagle3" else "block", "target": str(DEFAULT_TARGET_PATH),
                       "speculators": spec["output"], "inputs": dspec_inputs(name, target, root / f"{name}.safetensors"),
                       **({"engine": engine["output"], "engine_layout": engine["layout"]} if engine else {})}
    (root / "cases.json").write_text(json.dumps(cases))
    run_engine_script(engine_dir, "speculators_check.py", str(root / "cases.json"), str(root / "result.json"))
    return json.loads((root / "result.json").read_text())


@pytest.mark.parametrize("name", ENGINE_FORMAT)
def test_speculators_loads_the_speculators_export(results, name):
    got = results[name]["speculators"]
    assert got == {"missing": [], "unexpected": []}, got


@pytest.mark.parametrize("name", ENGINE_FORMAT)
def test_the_engine_export_holds_the_same_weights(results, name):
    if "engine" not in results[name]:
        pytest.skip(f"{name}: no {ENGINE_FORMAT[name]} export (refused in one line)")
    assert results[name]["engine"] == {"missing": [], "unexpected": [], "differ": []}, results[name]["engine"]


@pytest.mark.parametrize("name", ENGINE_FORMAT)
def test_speculators_reproduces_dspec_drafts(results, name):
    got = results[name]
    assert got["same_argmax"], got
    assert got["logits_max_abs_diff"] <= BF16 * got["logits_scale"], got
    if "confidence_max_abs_diff" in got:
        assert got["confidence_max_abs_diff"] is not None and got["confidence_max_abs_diff"] <= BF16, got


@pytest.mark.parametrize("name", ENGINE_FORMAT)
def test_the_check_fails_on_a_wrong_convention(results, name):
    """With the convention the export writes explicitly flipped (sample_from_anchor for the block
    drafters, norm_before_residual for EAGLE-3), speculators' logits leave the tolerance by far."""
    got = results[name]
    assert got["flipped_max_abs_diff"] > 10 * BF16 * got["logits_scale"], got
