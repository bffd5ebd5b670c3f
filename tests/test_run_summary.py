import json

from trlx_scale.tasks.run_summary import RunSummary


def test_summary_reads_rewards_and_renders_gain(tmp_path):
    summary = RunSummary(model="m", accuracy_before=0.375, accuracy_after=0.5)
    history = [
        {"reward": 0.25, "loss": 1.0, "sync/logprob_gap_max": 2e-6, "sync/bytes": 10.0},
        {"loss": 0.5, "sync/logprob_gap_max": 5e-6, "sync/bytes": 12.0},
        {"reward": 0.5},
    ]
    summary.read_log_history(history, global_step=30)
    assert (summary.steps, summary.reward_first, summary.reward_last) == (30, 0.25, 0.5)
    assert summary.sync_logprob_gap_max == 5e-6 and summary.sync_bytes_last == 12.0
    text = summary.render()
    assert "37.5% before -> 50.0% after" in text and "+12.5 points" in text and "5.0e-06" in text
    path = tmp_path / "sub" / "summary.json"
    summary.write_json(str(path))
    assert json.loads(path.read_text())["accuracy_after"] == 0.5
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temporary file left behind


def test_summary_without_evaluation():
    summary = RunSummary(model="m")
    summary.read_log_history([], global_step=0)
    assert "n/a before -> n/a after" in summary.render() and "gain" not in summary.render()
