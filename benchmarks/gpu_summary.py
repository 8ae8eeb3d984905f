"""The GPU check's summary: one Markdown page from the folder of a ``benchmarks/gpu_check.sh`` run.

That folder holds ``parts.tsv`` (one line per part: name, exit code, seconds, limit), ``env.log`` (the GPU and
the packages), each part's full log ``NAME.log``, and for each race part ``NAME.json`` (the race records that
``benchmarks/ppo_vs_trl.py --json`` saves after every round, so a part killed at its limit still has them).
:func:`race_section` also prints each race in ``ppo_vs_trl``'s own output. Torch-free: it runs after every part.

Run: ``python3 -m benchmarks.gpu_summary FOLDER > summary.md``.
"""

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

NAMES = {"ours": "ours", "ours-lora": "ours LoRA r=8", "trl": "TRL", "floor": "HF floor"}
CASES = {
    "fixed": "fixed shape: prompts {prompt_tokens} tokens, no stop token",
    "real": 'real job: prompts 4-{prompt_tokens} tokens (left-padded), stop_token "eos"',
}
GOAL_SMALL_REAL_S = 0.25
GOAL_LORA_RATIO = 1.2


def median_seconds(result: dict[str, Any]) -> float | None:
    return statistics.median(result["seconds"]) if result["seconds"] else None


def median_metric(result: dict[str, Any], name: str) -> float | None:
    values = [m[name] for m in result["metrics"] if name in m]
    return statistics.median(values) if values else None


def ratio(record: dict[str, Any], name: str, other: str) -> float | None:
    """``name``'s median s/update over ``other``'s in one race (None: either did not run a counted update)."""
    contestants = record["contestants"]
    if name not in contestants or other not in contestants:
        return None
    a, b = median_seconds(contestants[name]), median_seconds(contestants[other])
    return None if a is None or b is None else a / b


def memory_mib(result: dict[str, Any]) -> float | None:
    """A contestant's memory figure: its peak RSS above the baseline on CPU, its CUDA peak on GPU."""
    final = result["final"]
    if "peak_mib" not in final:
        return None
    return final["peak_mib"] if final.get("above_baseline_mib") is None else final["above_baseline_mib"]


def number(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def shapes(counts: dict[str, int] | None) -> str:
    return "none" if not counts else ", ".join(f"{shape}: {n}" for shape, n in sorted(counts.items()))


def decode_line(name: str, result: dict[str, Any]) -> str:
    """Which decode path ``name`` ran, from the statistics the engine logged at the job's end."""
    fraction = median_metric(result, "rollout/compiled_fraction")
    shown = "not reported" if fraction is None else f"{fraction:.2f}"
    stats = result["final"].get("decode_stats")
    if not stats:
        return f"- decode, {NAMES.get(name, name)}: not reported (compiled fraction {shown})"
    return (
        f"- decode, {NAMES.get(name, name)}: path {stats.get('path')}; steps compiled {stats.get('compiled_steps')}, "
        f"eager {stats.get('eager_steps')}; compiled fraction {shown}; compiles {shapes(stats.get('compiles'))}; "
        f"CUDA-graph recordings {shapes(stats.get('recordings'))}; cudagraph skips {stats.get('cudagraph_skips')}; "
        f"fallback {stats.get('fallback') or 'none'}"
    )


def race_section(record: dict[str, Any]) -> str:
    """One race in Markdown: each contestant's s/update, TFLOP/s, rollout/training split and memory, the ratios,
    the responses' stops and the decode path of ours."""
    shape, setting, cuda = record["shape"], record["setting"], record["device"] != "cpu"
    case = CASES.get(record["case"], record["case"]).format(prompt_tokens=record["prompt_tokens"])
    flops, peak = record["flops"], record["peak_tflops"]
    lines = [
        f"### {record['size']}, {case}",
        "",
        f"{record['device']}, {setting['dtype']}"
        + (", LoRA r=8 for every contestant" if setting["lora"] else "")
        + (", gradient checkpointing" if setting["gradient_checkpointing"] else "")
        + f"; {shape['n_layer']} layers × {shape['n_embd']}, batch {shape['batch']}, {shape['response']} response"
        f" tokens, vocabulary {shape['vocab'] or 574}; {record['minibatches']} minibatches, 1 epoch. One update:"
        f" {flops / 1e12:.3g} TFLOP at the padded shapes"
        + (f" ({flops / 1e12 / peak:.3f} s at the bf16 peak of {peak:g} TFLOP/s)." if cuda else "."),
        "",
        f"| contestant | s/update (median) | counted | min | max | TFLOP/s | % of bf16 peak | rollout s | train s"
        f" | {'peak MiB' if cuda else 'peak RSS MiB (above baseline)'} | left the race |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in record["contestants"].items():
        median = median_seconds(r)
        tflops = None if median is None else flops / median / 1e12
        achieved = "—" if tflops is None else f"{tflops:.3g}"
        percent = f"{tflops / peak:.1%}" if cuda and tflops is not None else "—"
        final = r["final"]
        memory = "—" if "peak_mib" not in final else f"{final['peak_mib']:.0f}"
        if final.get("above_baseline_mib") is not None:
            memory += f" ({final['above_baseline_mib']:.0f})"
        lines.append(
            f"| {NAMES.get(name, name)} | {number(median)} | {len(r['seconds'])} |"
            f" {number(min(r['seconds'], default=None))} | {number(max(r['seconds'], default=None))} |"
            f" {achieved} | {percent} | {number(median_metric(r, 'time/rollout_s'))} |"
            f" {number(median_metric(r, 'time/train_s'))} | {memory} | {r['failure'] or ''} |"
        )
    lines.append("")
    pairs = [
        ("ours", "trl"),
        ("ours", "floor"),
        ("ours-lora", "ours"),
        ("ours-lora-unfused", "ours"),
        ("ours", "ours-whole-logits"),
    ]
    shown = [
        f"{NAMES.get(a, a)} / {NAMES.get(b, b)} {number(ratio(record, a, b))}"
        for a, b in pairs
        if a in record["contestants"] and b in record["contestants"]
    ]
    if shown:
        lines.append("- ratios of s/update: " + "; ".join(shown))
    memory_ratios = []
    for a, b in (("ours", "trl"), ("ours", "ours-whole-logits")):
        if a in record["contestants"] and b in record["contestants"]:
            ours, theirs = memory_mib(record["contestants"][a]), memory_mib(record["contestants"][b])
            value = None if ours is None or not theirs else ours / theirs
            memory_ratios.append(f"{NAMES.get(a, a)} / {NAMES.get(b, b)} {number(value)}")
    if memory_ratios:
        lines.append("- ratios of memory: " + "; ".join(memory_ratios))
    warmup = [
        f"{NAMES.get(n, n)} {', '.join(f'{s:.1f}' for s in r['warmup_seconds']) or '—'}"
        for n, r in record["contestants"].items()
    ]
    lines.append("- warm-up updates, s (all contestants at once; compiles fall here): " + "; ".join(warmup))
    for name in ("ours", "ours-lora"):
        if name in record["contestants"]:
            r = record["contestants"][name]
            lines.append(
                f"- responses, {NAMES[name]}: EOS share {number(median_metric(r, 'response/eos_fraction'), 2)}, mean"
                f" length {number(median_metric(r, 'response/length_mean'), 1)} tokens"
            )
            lines.append(decode_line(name, r))
    return "\n".join(lines) + "\n"


def goal_lines(records: list[dict[str, Any]]) -> list[str]:
    """The issue's GPU goals, met or not, from the races that ran (bf16, full fine-tuning settings)."""
    races = {(r["size"], r["case"]): r for r in records if r and not r["setting"]["lora"]}
    lines = ["| goal | measured | |", "|---|---|---|"]

    def row(goal: str, value: float | None, met: bool | None) -> None:
        verdict = "not measured" if met is None else ("met" if met else "not met")
        lines.append(f"| {goal} | {number(value)} | {verdict} |")

    small_real = races.get(("small", "real"))
    ours = None if small_real is None else small_real["contestants"].get("ours")
    median = None if ours is None else median_seconds(ours)
    row(
        f"small, real job: ours ≤ {GOAL_SMALL_REAL_S} s/update",
        median,
        None if median is None else median <= GOAL_SMALL_REAL_S,
    )
    for case in ("real", "fixed"):
        lora = None if ("small", case) not in races else ratio(races[("small", case)], "ours-lora", "ours")
        row(f"small, {case}: LoRA ≤ {GOAL_LORA_RATIO} × full", lora, None if lora is None else lora <= GOAL_LORA_RATIO)
    for case in ("real", "fixed"):
        small, big = (
            None if (s, case) not in races else ratio(races[(s, case)], "ours", "trl") for s in ("small", "1b")
        )
        met = None if small is None or big is None else big <= small
        lines.append(
            f"| {case}: ours / TRL at 1b no worse than at small | 1b {number(big)}, small {number(small)} |"
            f" {'not measured' if met is None else ('met' if met else 'not met')} |"
        )
    return lines


def outcome(name: str, rc: int, folder: Path) -> str:
    """A part's outcome in words: its exit code, and for the tests pytest's own count."""
    if rc in (124, 137):
        said = "timed out at its limit"
    elif rc != 0:
        said = f"failed (exit code {rc})"
    else:
        said = "ok"
    log = folder / f"{name}.log"
    if name == "tests" and log.exists():
        counts = [
            line.strip("= ")
            for line in log.read_text(errors="replace").splitlines()
            if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)
        ]
        if counts:
            said += f": {counts[-1]}"
    return said


def summary(folder: Path) -> str:
    """The whole page: the environment, each part's outcome, the goals, then every race."""
    parts = [line.split("\t") for line in (folder / "parts.tsv").read_text().splitlines() if line.strip()]
    env = folder / "env.log"
    lines = ["# GPU check", ""]
    if env.exists():
        lines += ["```", env.read_text().strip(), "```", ""]
    lines += ["## Parts", "", "| part | outcome | seconds | limit |", "|---|---|---|---|"]
    total = 0
    for name, rc, seconds, limit in parts:
        lines.append(f"| {name} | {outcome(name, int(rc), folder)} | {seconds} | {limit} |")
        total += int(seconds)
    lines += ["", f"Parts so far: {total} s in all.", ""]
    records = []
    for name, *_ in parts:
        path = folder / f"{name}.json"
        if path.exists():
            records += [r for r in json.loads(path.read_text()) if r]
    lines += ["## Goals", "", *goal_lines(records), "", "## Races", ""]
    lines += [race_section(r) for r in records]
    tests = folder / "tests.log"
    if tests.exists():
        failed = [
            line for line in tests.read_text(errors="replace").splitlines() if line.startswith(("FAILED", "ERROR"))
        ]
        lines += ["## Tests", "", *(failed or ["no failures"]), ""]
    broken = [(name, rc) for name, rc, *_ in parts if int(rc) != 0]
    if broken:
        lines += ["## Ends of the logs of the parts that failed (the whole logs are in logs.tar.gz)", ""]
        for name, rc in broken:
            log = folder / f"{name}.log"
            tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else ["no log"]
            lines += [f"### {name} (exit code {rc})", "", "```", *tail, "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(summary(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
