"""The GPU check's summary (``benchmarks/gpu_summary.py``) from a run's folder: parts that timed out or failed,
races cut short, and the engine's decode statistics present or absent."""

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_summary import ratio, summary

DECODE_STATS = {
    "path": "compiled",
    "compiled_steps": 381,
    "eager_steps": 0,
    "compiles": {"64x176": 1},
    "recordings": {"64x176": 1},
    "cudagraph_skips": 0,
    "fallback": None,
}


def contestant(seconds: list[float], final: dict[str, Any], failure: str | None = None) -> dict[str, Any]:
    metrics = [{"time/rollout_s": s / 4, "time/train_s": 3 * s / 4, "rollout/compiled_fraction": 1.0} for s in seconds]
    return {"seconds": seconds, "warmup_seconds": [30.0], "metrics": metrics, "final": final, "failure": failure}


def record(size: str, case: str, contestants: dict[str, Any]) -> dict[str, Any]:
    return {
        "size": size,
        "shape": {"n_layer": 12, "n_head": 12, "n_embd": 768, "batch": 64, "response": 128, "vocab": 50257},
        "case": case,
        "prompt_tokens": 48,
        "minibatches": 2,
        "setting": {"dtype": "bfloat16", "lora": False, "gradient_checkpointing": False},
        "device": "NVIDIA H200",
        "flops": 2.0e13,
        "peak_tflops": 790.0,
        "contestants": contestants,
    }


def test_the_summary_reports_each_part_the_goals_and_the_decode_path(tmp_path: Path) -> None:
    (tmp_path / "parts.tsv").write_text("env\t0\t3\t20\nsmall-real\t124\t90\t90\ntests\t1\t40\t55\n")
    (tmp_path / "small-real.log").write_text("loading\nKilled at the limit\n")
    (tmp_path / "tests.log").write_text(
        "FAILED tests/engine/test_x.py::test_cuda_y - boom\n1 failed, 2 passed in 30s\n"
    )
    race = record(
        "small",
        "real",
        {
            "ours": contestant([0.2, 0.3, 0.25], {"peak_mib": 9000.0, "decode_stats": DECODE_STATS}),
            "ours-lora": contestant([0.3], {"peak_mib": 4000.0, "decode_stats": None}),
            "trl": contestant([2.0], {}, failure="died (exit code 1) in counted update 2"),
            "floor": contestant([], {}),
        },
    )
    (tmp_path / "small-real.json").write_text(json.dumps([race]))

    page = summary(tmp_path)

    assert "| small-real | timed out at its limit | 90 | 90 |" in page
    assert "| tests | failed (exit code 1): 1 failed, 2 passed in 30s | 40 | 55 |" in page
    assert "| small, real job: ours ≤ 0.25 s/update | 0.250 | met |" in page
    assert "| small, real: LoRA ≤ 1.2 × full | 1.200 | met |" in page
    assert "| small, fixed: LoRA ≤ 1.2 × full | — | not measured |" in page
    assert "ours / TRL 0.125" in page
    assert "ours / HF floor —" in page  # the floor ran no counted update
    assert "died (exit code 1) in counted update 2" in page
    assert "cudagraph skips 0" in page and "compiles 64x176: 1" in page and "path compiled" in page
    assert "- decode, ours LoRA r=8: not reported (compiled fraction 1.00)" in page
    assert "FAILED tests/engine/test_x.py::test_cuda_y - boom" in page
    assert "Killed at the limit" in page  # the end of a failed part's log


def test_ratio_is_of_the_medians() -> None:
    race = record("1b", "fixed", {"ours": contestant([1.0, 5.0, 2.0], {}), "trl": contestant([4.0, 8.0], {})})
    assert ratio(race, "ours", "trl") == 2.0 / 6.0
    assert ratio(race, "ours", "floor") is None
