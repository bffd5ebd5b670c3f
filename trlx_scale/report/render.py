"""Draw a run's plots (PNG, matplotlib's headless Agg backend) and write its markdown summary."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from ..atomic_files import replace_atomically, write_text_atomically
from ..profiling.phase_timer import PHASES
from .run_history import RunHistory

# The reward each trainer logs, in order of preference: GRPO/PPO, online DPO, offline DPO (reward margin).
REWARD_KEYS = ("reward", "online/reward_mean", "rewards/margins")
# The mean reward of the trainer's evaluation, which the reward plot draws beside the training reward.
EVAL_REWARD_KEY = "eval_reward"
KL_KEYS = ("kl", "ppo/kl", "ppo/approx_kl")
CLIP_KEYS = ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "ppo/value_clipfrac")
REPORT_EXTRA_HINT = "pip install 'trlx-scale[report]' (matplotlib)"


@dataclass
class Report:
    """What ``write_report`` produced."""

    directory: str
    markdown: str
    images: list[str]


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"trlx-scale report draws with matplotlib: {REPORT_EXTRA_HINT}.") from error
    matplotlib.use("Agg")  # files only, no display (servers, CI)
    import matplotlib.pyplot as plt

    return plt


def _no_data(axis, what: str) -> None:
    axis.text(0.5, 0.5, f"{what}: not logged by this run", ha="center", va="center", transform=axis.transAxes)
    axis.set_xticks([])
    axis.set_yticks([])


def _plot_reward(plt, history: RunHistory, path: str) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    key = history.first_present(REWARD_KEYS)
    if key is None:
        _no_data(axis, "reward")
    else:
        steps, values = history.series(key)
        axis.plot(steps, values, color="tab:blue", label=key)
        axis.set_xlabel("step")
        axis.set_ylabel(key, color="tab:blue")
        # The trainer's evaluation (--eval_strategy): the same reward functions on held-out prompts.
        if history.first_present((EVAL_REWARD_KEY,)) is not None:
            steps, values = history.series(EVAL_REWARD_KEY)
            axis.plot(steps, values, "s-", color="tab:orange", label=f"{EVAL_REWARD_KEY} (held-out prompts)")
            axis.legend(loc="upper left", fontsize="small")
    before, after = history.summary.get("accuracy_before"), history.summary.get("accuracy_after")
    # The held-out accuracy measured during the run (step, accuracy), before and after included; older summaries
    # only have the two ends.
    curve = [tuple(point) for point in history.summary.get("accuracy_curve") or []]
    if not curve and before is not None and after is not None and history.entries:
        curve = [(0, before), (history.entries[-1]["step"], after)]
    if curve:
        accuracy = axis.twinx()
        steps, values = zip(*curve, strict=True)
        accuracy.plot(steps, [100 * v for v in values], "o--", color="tab:green", label="held-out accuracy")
        for step, value in (curve[0], curve[-1]):
            accuracy.annotate(f"{100 * value:.1f}%", (step, 100 * value), textcoords="offset points", xytext=(4, 6))
        accuracy.set_ylabel("held-out accuracy (%)", color="tab:green")
    axis.set_title("Reward and held-out accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=80, format="png")  # the path may be a temporary name
    plt.close(figure)


def _plot_series_panel(axis, history: RunHistory, keys: tuple[str, ...], title: str) -> None:
    """One line per logged key of ``keys`` on ``axis``, or a "not logged" note."""
    present = [k for k in keys if history.series(k)[0]]
    for key in present:
        axis.plot(*history.series(key), label=key)
    if not present:
        _no_data(axis, title)
        return
    axis.set_xlabel("step")
    axis.legend(fontsize=8)
    axis.set_title(title)


def _plot_kl_clip(plt, history: RunHistory, path: str) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    _plot_series_panel(left, history, KL_KEYS, "KL")
    _plot_series_panel(right, history, CLIP_KEYS, "clip fractions")
    figure.tight_layout()
    figure.savefig(path, dpi=80, format="png")  # the path may be a temporary name
    plt.close(figure)


def _phase_table(history: RunHistory) -> tuple[list[int], dict[str, list[float]]]:
    entries = [e for e in history.entries if "time/step" in e]
    steps = [e["step"] for e in entries]
    phases = {p: [e.get(f"time/{p}", 0.0) for e in entries] for p in PHASES if p != "ref_scoring"}
    return steps, {p: values for p, values in phases.items() if any(values)}


def _plot_phases(plt, history: RunHistory, path: str) -> None:
    figure, axis = plt.subplots(figsize=(8, 4))
    steps, phases = _phase_table(history)
    if not steps:
        _no_data(axis, "time per phase (profile_phases)")
    else:
        bottom = [0.0] * len(steps)
        colors = plt.get_cmap("tab10").colors
        # Bars as wide as the logging interval allows (logging_steps apart), not one step wide.
        spacing = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)
        for index, (name, values) in enumerate(phases.items()):
            color = colors[index % len(colors)]
            axis.bar(steps, values, bottom=bottom, label=name, color=color, width=0.8 * spacing)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axis.set_xlabel("step")
        axis.set_ylabel("seconds (slowest rank)")
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        axis.set_title("Time per phase per step")
    figure.tight_layout()
    figure.savefig(path, dpi=80, format="png")  # the path may be a temporary name
    plt.close(figure)


def _plot_throughput(plt, history: RunHistory, path: str) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    plotted = False
    for key, color in (
        ("throughput/generated_tokens_per_s", "tab:orange"),
        ("throughput/trained_tokens_per_s", "tab:purple"),
    ):
        steps, values = history.series(key)
        if steps:
            axis.plot(steps, values, color=color, label=key.split("/")[1])
            plotted = True
    if plotted:
        axis.set_xlabel("step")
        axis.set_ylabel("tokens / s (whole job)")
        axis.legend(fontsize=8, loc="upper left")
        steps, mfu = history.series("perf/mfu")
        if steps:
            right = axis.twinx()
            right.plot(steps, [100 * v for v in mfu], color="tab:gray", linestyle=":", label="MFU")
            right.set_ylabel("MFU (%)", color="tab:gray")
        axis.set_title("Throughput and MFU")
    else:
        _no_data(axis, "throughput (profile_phases)")
    figure.tight_layout()
    figure.savefig(path, dpi=80, format="png")  # the path may be a temporary name
    plt.close(figure)


def _median_after_first(values: list[float]) -> float | None:
    values = values[1:] if len(values) > 1 else values  # the first step carries warm-up (engine, kernels)
    return statistics.median(values) if values else None


def _dynamic_sampling_rows(history: RunHistory) -> list[tuple[str, str]]:
    """What dynamic sampling did (grpo.dynamic_sampling), where the run had it on: means over the logged steps."""
    means = {}
    for key in (
        "batch/zero_variance_frac",
        "batch/filled_frac",
        "batch/generation_rounds",
        "batch/oversampling_factor",
        "batch/carried_groups",
    ):
        values = history.series(key)[1]
        if values:
            means[key] = statistics.fmean(values)
    if not means:
        return []
    return [
        (
            "dynamic sampling (mean per step)",
            f"{100 * means.get('batch/zero_variance_frac', 0):.0f}% of sampled groups without signal, batch "
            f"{100 * means.get('batch/filled_frac', 0):.0f}% filled with informative groups, "
            f"{means.get('batch/generation_rounds', 1):.2f} generation rounds, over-sampling "
            f"{means.get('batch/oversampling_factor', 1):.2f}x, {means.get('batch/carried_groups', 0):.2f} carried-over "
            "groups",
        )
    ]


def _markdown(history: RunHistory, images: list[str]) -> str:
    summary = history.summary
    lines = ["# Run report", "", f"Read from `{history.source}` ({len(history.entries)} logged steps).", ""]
    rows: list[tuple[str, str]] = []
    if summary.get("model"):
        rows.append(("model", f"`{summary['model']}` on {summary.get('world_size', 1)} process(es)"))
    step_time = _median_after_first(history.series("time/step")[1])
    if step_time is not None:
        rows.append(("step time (median after the first)", f"{step_time:.3f} s"))
        _, phases = _phase_table(history)
        total = sum(sum(v[1:] or v) for v in phases.values()) or 1.0
        shares = sorted(((sum(v[1:] or v) / total, name) for name, v in phases.items()), reverse=True)
        rows.append(("time per phase", ", ".join(f"{name} {100 * share:.0f}%" for share, name in shares)))
    for key, label, scale, unit in (
        ("throughput/generated_tokens_per_s", "generated tokens/s (median)", 1, ""),
        ("throughput/trained_tokens_per_s", "trained tokens/s (median)", 1, ""),
        ("perf/mfu", "MFU (median)", 100, "%"),
    ):
        value = _median_after_first(history.series(key)[1])
        if value is not None:
            rows.append((label, f"{scale * value:.3g}{unit}"))
    rows += _dynamic_sampling_rows(history)
    reward_key = history.first_present(REWARD_KEYS)
    if reward_key is not None:
        values = history.series(reward_key)[1]
        rows.append((f"{reward_key} (first -> last log)", f"{values[0]:.3f} -> {values[-1]:.3f}"))
    if summary.get("accuracy_before") is not None and summary.get("accuracy_after") is not None:
        before, after = 100 * summary["accuracy_before"], 100 * summary["accuracy_after"]
        rows.append(("held-out accuracy", f"{before:.1f}% -> {after:.1f}% ({after - before:+.1f} points)"))
    if summary.get("memory_measured_peak_gib") is not None:
        planned = summary.get("memory_planned_peak_gib")
        text = f"{summary['memory_measured_peak_gib']:.2f} GiB measured"
        rows.append(("peak memory", text + (f", {planned:.2f} GiB planned" if planned is not None else "")))
    lines += ["| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows], ""]
    lines += [f"![{os.path.splitext(name)[0]}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def write_report(output_dir: str, report_dir: str | None = None) -> Report:
    """Read ``output_dir``'s logs and write ``report.md`` and the PNGs into ``report_dir`` (default
    ``output_dir/report``). Files are written whole (temporary name, then rename)."""
    history = RunHistory.load(output_dir)
    plt = _pyplot()
    report_dir = report_dir or os.path.join(output_dir, "report")
    os.makedirs(report_dir, exist_ok=True)
    images = []
    for name, draw in (
        ("reward.png", _plot_reward),
        ("kl_clip.png", _plot_kl_clip),
        ("phases.png", _plot_phases),
        ("throughput.png", _plot_throughput),
    ):
        replace_atomically(os.path.join(report_dir, name), lambda temporary, draw=draw: draw(plt, history, temporary))
        images.append(name)
    markdown = os.path.join(report_dir, "report.md")
    write_text_atomically(markdown, _markdown(history, images))
    return Report(report_dir, markdown, [os.path.join(report_dir, name) for name in images])
