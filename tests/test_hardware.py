"""SPS(B) profiling and the cost table: grid, lookups, monotone cleanup, provenance checks,
``dspec profile-hardware`` on a tiny model."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tiny_models import FACTORIES, tiny_qwen3
from tiny_models import assert_cli_error as _bad
from tiny_models import run_cli as run

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import (
    CostTable,
    CostTableMismatch,
    default_grid,
    device_name,
    isotonic,
)
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.target_profile import profile_target


def make_table(measured: dict, grid=(1, 2, 4, 8), **kw) -> CostTable:
    base = dict(device="cpu", device_name=device_name("cpu"), dtype="float32", model="tiny", torch=torch.__version__)
    return CostTable(**{**base, **kw}, grid=list(grid), contexts=sorted(int(c) for c in measured),
                     measured={str(c): v for c, v in measured.items()})


def test_default_grid():
    grid = default_grid(256)
    assert grid[:16] == list(range(1, 17)) and grid[-1] == 256 and grid == sorted(set(grid))
    assert 64 in grid and 128 in grid and 65 not in grid  # denser at small B
    assert default_grid(1) == [1] and default_grid(300)[-2:] == [288, 300]
    with pytest.raises(DspecError, match="--max-batch-tokens must be >= 1"):
        default_grid(0)


def test_lookup_interpolates_step_time_and_extrapolates():
    table = make_table({128: [100.0, 50.0, 25.0, 10.0]})
    assert table.sps(2) == pytest.approx(50.0)
    assert table.sps(3) == pytest.approx(1 / ((0.02 + 0.04) / 2))  # linear in step time
    assert table.sps(16) == pytest.approx(5.0)  # past the grid: time grows with B
    assert table.sps(1, context=10_000) == pytest.approx(100.0)  # contexts clamp
    curve = table.sps_curve(20)
    assert curve.shape[0] >= 21 and float(curve[0]) == pytest.approx(100.0)
    assert [float(curve[b]) for b in (1, 3, 16)] == pytest.approx([table.sps(b) for b in (1, 3, 16)])
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        table.sps(0)


def test_isotonic_fit():
    t = torch.tensor
    assert isotonic(t([1.0, 2.0, 2.0, 5.0])).tolist() == [1.0, 2.0, 2.0, 5.0]  # already monotone
    assert isotonic(t([1.0, 3.0, 2.0, 4.0])).tolist() == [1.0, 2.5, 2.5, 4.0]  # a violating pair is pooled
    assert isotonic(t([3.0, 2.0, 1.0])).tolist() == [2.0, 2.0, 2.0]
    # a flat stretch with one slow outlier stays (nearly) flat: a running max would lift every
    # later point to the outlier and invent a marginal cost
    flat = t([10.0, 12.0, 11.0, 13.0, 11.0, 12.0, 11.0, 12.0])
    fit = isotonic(flat)
    assert bool((fit[1:] >= fit[:-1]).all()) and float(fit[-1]) == 12.0 < float(flat.cummax(0).values[-1])
    assert float(fit.mean()) == pytest.approx(float(flat.mean()))  # least squares keeps the mean


def test_monotone_cleanup_and_contexts():
    table = make_table({128: [100.0, 40.0, 60.0, 20.0], 512: [50.0, 25.0, 20.0, 10.0]})
    # the noisy bump at B = 4 is pooled with B = 2: both get the mean step time
    assert table.sps(2, context=128) == pytest.approx(table.sps(4, context=128)) == pytest.approx(1 / ((1 / 40 + 1 / 60) / 2))
    assert table.measured["128"][2] == 60.0  # raw values are kept
    curve = table.sps_curve(40, context=128)
    assert bool((curve[2:] <= curve[1:-1] + 1e-12).all())  # non-increasing
    mid = table.sps(1, context=320)  # halfway between the two contexts: step time averaged
    assert mid == pytest.approx(1 / ((0.01 + 0.02) / 2))
    assert table.sps(1) == pytest.approx(mid)  # context=None: mean step time over contexts


def test_save_load_and_validation(tmp_path):
    table = make_table({128: [100.0, 50.0, 25.0, 10.0]}, spread={"128": [1.0, 1.0, 1.0, 1.0]})
    path = tmp_path / "cost.json"
    table.save(path)
    raw = json.loads(path.read_text())
    assert {"device", "device_name", "dtype", "model", "torch", "grid", "contexts", "sps", "spread"} <= set(raw)
    back = CostTable.load(path)
    assert back.sps(3) == pytest.approx(table.sps(3)) and back.source == str(path)
    raw["sps"]["128"] = [1.0, 2.0]
    path.write_text(json.dumps(raw))
    with pytest.raises(DspecError, match=r"sps\[128\] must list one value per grid point"):
        CostTable.load(path)
    raw["sps"]["128"] = [1.0, 2.0, 0.0, 1.0]
    path.write_text(json.dumps(raw))
    with pytest.raises(DspecError, match=r"sps.128\[2\]: should be greater than 0"):
        CostTable.load(path)
    path.write_text("{")
    with pytest.raises(DspecError, match="not valid JSON"):
        CostTable.load(path)
    with pytest.raises(DspecError, match="file not found"):
        CostTable.load(tmp_path / "nope.json")


def test_check_device_and_model():
    table = make_table({128: [10.0, 9.0, 8.0, 7.0]}, device_name="NVIDIA H200", model="Qwen/Qwen3-4B")
    with pytest.warns(CostTableMismatch, match="profiled on 'NVIDIA H200'"):
        problems = table.check(device="cpu", model="Qwen/Qwen3-4B")
    assert len(problems) == 1
    with pytest.raises(DspecError, match="profiled for model 'Qwen/Qwen3-4B', this run uses 'x'"):
        table.check(model="x", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_table({128: [1.0] * 4}).check(device="cpu", model="tiny") == []


@pytest.mark.parametrize("family", list(FACTORIES))
def test_profile_tiny_models(family):
    calls = []
    table = profile_target(Target(FACTORIES[family]()), grid=[1, 2, 5, 9], contexts=[4, 16], repeats=3, warmup=1,
                           row_tokens=4, model_name=family, progress=lambda c, b: calls.append((c, b)))
    assert table.grid == [1, 2, 5, 9] and table.contexts == [4, 16] and table.model == family
    assert all(len(v) == 4 and min(v) > 0 for v in table.measured.values())
    assert all(min(v) >= 0 for v in table.spread.values())
    assert sorted(calls) == sorted((c, b) for c in (4, 16) for b in (1, 2, 5, 9))
    assert table.device == "cpu" and table.torch == torch.__version__ and table.dtype == "float32"


def test_profile_rejects_contexts_past_the_model():
    with pytest.raises(DspecError, match="exceeds the model's context of 256"):
        profile_target(Target(tiny_qwen3()), grid=[1], contexts=[250], row_tokens=8)








def test_profile_cli(model_dir, tmp_path, capsys):
    out, png = tmp_path / "cost.json", tmp_path / "png" / "sps.png"
    code, stdout, _ = run(["profile-hardware", "--target", str(model_dir), "--max-batch-tokens", "6",
                           "--contexts", "8,32", "--repeats", "2", "--warmup", "0", "--json", str(out),
                           "--plots", str(png.parent)], capsys)
    assert code == 0 and "SPS(B)" in stdout
    table = CostTable.load(out)
    assert table.grid == [1, 2, 3, 4, 5, 6] and table.contexts == [8, 32] and table.model == str(model_dir)
    assert table.check(device="cpu", model=str(model_dir)) == []
    assert png.stat().st_size > 1000


def test_profile_default_contexts_are_clipped_to_the_target(model_dir, tmp_path, capsys):
    out = tmp_path / "cost.json"
    code, _, err = run(["profile-hardware", "--target", str(model_dir), "--grid", "1", "--repeats", "1",
                        "--warmup", "0", "--json", str(out)], capsys)
    assert code == 0, err
    assert "Warning: the target's context is 256 tokens: profiling contexts 128,248 (the default 128,512,2048 clipped)" in err
    assert CostTable.load(out).contexts == [128, 248]


def test_profile_cli_bad_input(model_dir, capsys):
    base = ["profile-hardware", "--target", str(model_dir)]
    _bad(base + ["--max-batch-tokens", "0"], capsys, "Invalid value for '--max-batch-tokens'")
    _bad(base + ["--contexts", "0,8"], capsys, "--contexts values must be >= 1")
    _bad(base + ["--contexts", "8,abc"], capsys, "--contexts must be a comma-separated list")
    _bad(base + ["--repeats", "0"], capsys, "Invalid value for '--repeats'")
    _bad(base + ["--contexts", "4096", "--grid", "1"], capsys, "exceeds the model's context of 256")


def test_slow_half_precision_warning(monkeypatch, model_dir):
    """bf16 / fp16 on a CPU without native support warns once at load; native or GPU: silent."""
    import dspec_cli.core.hardware as hw
    from dspec_cli.runtime.target import Target

    monkeypatch.setattr(hw, "cpu_native_half", lambda dtype: False)
    with pytest.warns(hw.SlowHalfPrecision, match="bfloat16 on this CPU .*use --dtype float32"):
        Target.load(str(model_dir), dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hw.SlowHalfPrecision)
        Target.load(str(model_dir), dtype="float32")
        assert not hw.warn_if_slow_half(torch.bfloat16, "cuda")
        monkeypatch.setattr(hw, "cpu_native_half", lambda dtype: True)
        assert not hw.warn_if_slow_half(torch.bfloat16, "cpu")


def test_cpu_native_half_reads_cpu_flags(monkeypatch):
    """x86 Linux: True / False from the cpuinfo flags; None for other dtypes, machines or no cpuinfo."""
    import dspec_cli.core.hardware as hw

    monkeypatch.setattr(hw.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hw, "_cpuinfo", lambda: ["flags\t\t: fpu avx2 avx512f avx512_bf16"])
    assert hw.cpu_native_half(torch.bfloat16) is True and hw.cpu_native_half(torch.float16) is False
    assert hw.cpu_native_half(torch.float32) is None
    monkeypatch.setattr(hw, "_cpuinfo", lambda: ["flags\t\t: fpu avx2"])
    assert hw.cpu_native_half(torch.bfloat16) is False
    monkeypatch.setattr(hw, "_cpuinfo", lambda: [])
    assert hw.cpu_native_half(torch.bfloat16) is None
    monkeypatch.setattr(hw, "_cpuinfo", lambda: ["flags\t\t: fpu avx2 avx512_bf16"])
    monkeypatch.setattr(hw.platform, "machine", lambda: "aarch64")
    assert hw.cpu_native_half(torch.bfloat16) is None


def test_cpu_device_name_is_the_cpu_model(monkeypatch):
    """A CPU cost table names the CPU model, so one from another CPU is flagged."""
    import dspec_cli.core.hardware as hw

    monkeypatch.setattr(hw, "_cpuinfo", lambda: ["processor\t: 0", "model name\t: AMD EPYC 9B14", "flags\t: avx2"])
    assert device_name("cpu") == "AMD EPYC 9B14"
    monkeypatch.setattr(hw, "_cpuinfo", lambda: [])
    assert device_name("cpu") == (hw.platform.processor() or hw.platform.machine())
    table = make_table({128: [1.0] * 4}, device_name="Intel Xeon")
    monkeypatch.setattr(hw, "_cpuinfo", lambda: ["model name\t: AMD EPYC 9B14"])
    with pytest.warns(CostTableMismatch, match="profiled on 'Intel Xeon', this run uses 'AMD EPYC 9B14'"):
        table.check(device="cpu")
