"""`trlx-scale report`: plots and a markdown summary drawn from a real short run's logs."""

import json

import pytest

from trlx_scale.cli import main as cli_main
from trlx_scale.report.run_history import RunHistory

from .helpers.trainers import small_grpo_config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, default_model_dir):
    """A 3-step GRPO run with the colocated engine, saved as the examples save it (trainer_state.json and
    run_summary.json), plus a checkpoint."""
    from peft import LoraConfig

    from trlx_scale import GRPOTrainer
    from trlx_scale.tasks import addition_dataset, exact_match_reward
    from trlx_scale.tasks.run_summary import RunSummary

    out = tmp_path_factory.mktemp("report_run")
    args = small_grpo_config(out, use_vllm=True, vllm_dtype="trainer", max_steps=3, beta=0.05)
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=64),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    trainer.save_state()
    summary = RunSummary(model=default_model_dir, accuracy_before=0.30, accuracy_after=0.45)
    summary.read_log_history(trainer.state.log_history, trainer.state.global_step)
    summary.write_json(str(out / "run_summary.json"))
    return out


def _png_pixels(path):
    import matplotlib.image

    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(str(path))


def test_report_writes_plots_and_summary(finished_run, tmp_path, capsys):
    target = tmp_path / "report"
    assert cli_main(["report", str(finished_run), "--output", str(target)]) == 0
    printed = capsys.readouterr().out
    assert f"report: {target / 'report.md'}" in printed
    for name in ("reward.png", "kl_clip.png", "phases.png", "throughput.png"):
        pixels = _png_pixels(target / name)
        height, width = pixels.shape[:2]
        assert height >= 200 and width >= 400, name
        assert pixels[..., :3].std() > 0.05, f"{name} is blank"  # something was drawn
    markdown = (target / "report.md").read_text()
    assert "step time (median after the first)" in markdown
    assert "held-out accuracy | 30.0% -> 45.0% (+15.0 points)" in markdown
    assert "![phases](phases.png)" in markdown
    assert "generation" in markdown and "loss_forward_backward" in markdown  # the phase shares
    assert not list(target.glob("*.tmp-*")), "no half-written file is left"


def test_history_reads_the_logged_steps(finished_run):
    history = RunHistory.load(str(finished_run))
    steps, rewards = history.series("reward")
    assert steps == [1, 2, 3] and len(rewards) == 3
    assert history.first_present(("kl", "ppo/kl")) == "kl"  # beta > 0: TRL logs the KL
    assert len(history.series("time/generation")[0]) == 3


def test_report_of_a_run_still_going_reads_its_newest_checkpoint(finished_run, tmp_path):
    """No trainer_state.json at the top (the run has not finished): the newest checkpoint's is read."""
    running = tmp_path / "running"
    (running / "checkpoint-2").mkdir(parents=True)
    state = json.loads((finished_run / "trainer_state.json").read_text())
    state["log_history"] = [e for e in state["log_history"] if e.get("step", 0) <= 2]
    (running / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    assert cli_main(["report", str(running)]) == 0
    assert (running / "report" / "phases.png").is_file()
    assert "(2 logged steps)" in (running / "report" / "report.md").read_text()


def test_bad_output_dirs_get_a_clear_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory: pass a run's output_dir" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "no trainer_state.json in" in capsys.readouterr().err


def test_reward_plot_draws_the_accuracy_curve_when_the_run_measured_one(finished_run, tmp_path):
    """A run that measured held-out accuracy during training (examples' --eval_every_steps) gets its curve: the
    plot differs from the one of the same run with only the two ends."""
    import shutil

    curve_run = tmp_path / "curve_run"
    shutil.copytree(finished_run, curve_run)
    summary = json.loads((curve_run / "run_summary.json").read_text())
    summary["accuracy_curve"] = [[0, 0.30], [1, 0.60], [2, 0.35], [3, 0.45]]
    (curve_run / "run_summary.json").write_text(json.dumps(summary))
    assert cli_main(["report", str(curve_run), "--output", str(tmp_path / "with_curve")]) == 0
    assert cli_main(["report", str(finished_run), "--output", str(tmp_path / "ends_only")]) == 0
    with_curve = _png_pixels(tmp_path / "with_curve" / "reward.png")
    ends_only = _png_pixels(tmp_path / "ends_only" / "reward.png")
    assert with_curve.shape == ends_only.shape and abs(with_curve - ends_only).max() > 0.1


def test_reward_plot_draws_the_evaluation_reward_when_the_run_evaluated(finished_run, tmp_path):
    """A run evaluated by the trainer (--eval_strategy steps) logs eval_reward: the reward plot draws it, so it
    differs from the plot of the same run without those entries."""
    import shutil

    evaluated = tmp_path / "evaluated"
    shutil.copytree(finished_run, evaluated)
    state = json.loads((evaluated / "trainer_state.json").read_text())
    state["log_history"] += [{"step": step, "eval_reward": value} for step, value in ((1, 0.1), (2, 0.9), (3, 0.5))]
    (evaluated / "trainer_state.json").write_text(json.dumps(state))
    assert RunHistory.load(str(evaluated)).series("eval_reward") == ([1, 2, 3], [0.1, 0.9, 0.5])
    assert cli_main(["report", str(evaluated), "--output", str(tmp_path / "with_eval")]) == 0
    assert cli_main(["report", str(finished_run), "--output", str(tmp_path / "without")]) == 0
    with_eval = _png_pixels(tmp_path / "with_eval" / "reward.png")
    without = _png_pixels(tmp_path / "without" / "reward.png")
    assert with_eval.shape == without.shape and abs(with_eval - without).max() > 0.1


def test_held_out_curve_scores_every_n_steps_and_keeps_the_random_state():
    from types import SimpleNamespace

    import torch

    from trlx_scale.tasks.example_runtime import HeldOutAccuracyCurve

    values = iter([0.5, 0.6])

    def accuracy():
        torch.rand(3)  # an evaluation that draws random numbers must not change the training's
        return next(values)

    curve = HeldOutAccuracyCurve(accuracy, every=2)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    for completed in range(6):  # steps 1..6 begin after 0..5 completed ones; the run's "after" follows step 6
        curve.on_step_begin(None, SimpleNamespace(global_step=completed, max_steps=6), None)
    assert curve.points == [(2, 0.5), (4, 0.6)]
    assert torch.equal(torch.rand(1), expected)
    with pytest.raises(ValueError, match="--eval_every_steps must be >= 0"):
        HeldOutAccuracyCurve(accuracy, every=-1)


def test_report_says_what_dynamic_sampling_did(tmp_path):
    """A run with dynamic sampling on: the summary's row is the mean of its per-step metrics; a run without has none."""
    from trlx_scale.report.render import _markdown

    entries = [
        {"step": 1, "loss": 0.1, "batch/zero_variance_frac": 0.5, "batch/filled_frac": 1.0},
        {"step": 2, "loss": 0.1, "batch/zero_variance_frac": 0.3, "batch/filled_frac": 0.5},
    ]
    for entry, rounds, factor, carried in zip(entries, (2.0, 1.0), (1.0, 2.0), (0.0, 1.0), strict=True):
        entry.update({"batch/generation_rounds": rounds, "batch/oversampling_factor": factor})
        entry["batch/carried_groups"] = carried
    markdown = _markdown(RunHistory(source="logs", entries=entries), [])
    assert (
        "| dynamic sampling (mean per step) | 40% of sampled groups without signal, batch 75% filled with informative "
        "groups, 1.50 generation rounds, over-sampling 1.50x, 0.50 carried-over groups |"
    ) in markdown
    plain = _markdown(RunHistory(source="logs", entries=[{"step": 1, "loss": 0.1}]), [])
    assert "dynamic sampling" not in plain
