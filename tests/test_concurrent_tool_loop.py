"""GRPOTrainer's tool-calling turns without lockstep (agents/colocated_tool_loop.py) on the real vLLM CPU engine:
the same tokens, masks and messages as TRL's lockstep loop, a trajectory's tools never wait for the others', a hung
tool is a tool error, and a TRL ``environment_factory`` environment runs unchanged."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from datasets import Dataset

from trlx_scale import GRPOTrainer
from trlx_scale.tasks.tool_chat_template import with_tool_template

from .helpers.inc_tool_calls import EVERY_TURN_CALLS_INC, inc, inc_dataset, length_reward
from .helpers.trainers import logged, small_grpo_config


class _RecordingGRPOTrainer(GRPOTrainer):
    """Keeps what the tool loop returned (a test's subclass: the trainer's own code runs unchanged)."""

    def _tool_call_loop(self, *args):
        self.recorded_loop = super()._tool_call_loop(*args)
        return self.recorded_loop


def _config(tmp_path, name: str, **overrides):
    return small_grpo_config(tmp_path / name, **{**EVERY_TURN_CALLS_INC, **overrides})


def _train(tmp_path, name, default_model_dir, default_tokenizer, trainer_cls=_RecordingGRPOTrainer, **kwargs):
    from transformers import AutoModelForCausalLM

    overrides = kwargs.pop("config", {})
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
        reward_funcs=length_reward,
        args=_config(tmp_path, name, **overrides),
        train_dataset=inc_dataset(2),
        processing_class=with_tool_template(default_tokenizer),
        **kwargs,
    )
    trainer.train()
    return trainer


def test_concurrent_turns_equal_trls_lockstep_loop(tmp_path, default_model_dir, default_tokenizer):
    """At top_k=1 (greedy, any seed) both loops must sample the same turns: then the completion ids, the tool masks
    (0 exactly on the rendered tool results, 1 on every sampled token, end token included), the log-probs (0 on
    tool tokens), the messages and the counts must be equal, item by item."""
    runs = {}
    for scheduling in ("lockstep", "concurrent"):
        trainer = _train(
            tmp_path,
            scheduling,
            default_model_dir,
            default_tokenizer,
            tools=[inc],
            config=dict(tool_scheduling=scheduling, generation_kwargs={"top_k": 1}),
        )
        runs[scheduling] = trainer.recorded_loop
        tokenizer = trainer.processing_class
    lockstep, concurrent = runs["lockstep"], runs["concurrent"]
    tool_mask, completions, completion_ids, logprobs, calls, failures, _ = concurrent
    assert completion_ids == lockstep[2]
    assert tool_mask == lockstep[0]
    assert completions == lockstep[1]
    assert (calls, failures) == (lockstep[4], lockstep[5]) == (16, 0)  # 8 trajectories x 2 rounds, none failed
    # The calls are written as the template writes them: before each later turn, the held ids are a prefix of the
    # template's rendering of the whole conversation (the check ran: prefix_mismatch="keep" is the default).
    assert logged(trainer, "agents/prefix_mismatches") == [0.0]
    for ours, theirs in zip(logprobs, lockstep[3], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    # By hand for one trajectory: call, result, call, result, call; each call ends on the end token (trained).
    ids, mask = completion_ids[0], tool_mask[0]
    assert len(mask) == len(ids)
    text_trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    text_masked = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert text_trained.count("<call>") == 3 and text_trained.count("<|end|>") == 3
    assert text_masked.count("<tool>") == 2 and "<call>" not in text_masked
    assert [message["role"] for message in completions[0]] == ["assistant", "tool"] * 2 + ["assistant"]
    first = completions[0][0]["tool_calls"][0]["function"]
    assert completions[0][1]["content"] == str(first["arguments"]["a"] + 1)
    for index, ours in enumerate(logprobs):
        assert all(value == 0.0 for value, m in zip(ours, tool_mask[index], strict=True) if not m)


class _WaitingCalculator:
    """A TRL ``environment_factory`` environment (reset / public tools / get_reward), written for TRL. The first
    instance's first call waits until six others have made all their calls: in a lockstep loop (each round waits for
    every trajectory's tools, one after another) that never happens; here each trajectory goes on alone. The second
    instance's first call hangs past ``tool_timeout``. Every ``reset`` waits at a barrier for the batch's other
    resets: TRL's loop (one reset after another on the trainer's thread) would never pass it."""

    instances: list = []
    lock = threading.Lock()
    others_done = threading.Event()
    resets_together: threading.Barrier | None = None
    reset_threads: list = []
    expected_calls = 0
    timeout = 0.0

    def reset(self, **row):
        self.reset_threads.append(threading.current_thread().name)
        self.resets_together.wait()
        with self.lock:
            self.index = len(self.instances)
            self.instances.append(self)
        self.calls = 0

    def inc(self, a: int) -> int:
        """Add one to an integer.

        Args:
            a: The integer.
        """
        self.calls += 1
        if self.index == 0 and self.calls == 1:
            if not self.others_done.wait(self.timeout - 1):  # within its own timeout
                raise TimeoutError("the other trajectories never made their calls: this one held them")
        elif self.index == 1 and self.calls == 1:
            time.sleep(self.timeout + 4)  # hung: a tool error for the model, not a crash and not a hang
        with self.lock:
            if sum(instance.calls for instance in self.instances[2:]) >= self.expected_calls:
                self.others_done.set()
        return a + 1

    def get_reward(self) -> float:
        return float(self.calls)


def test_a_trajectory_waiting_on_its_tool_holds_no_other_and_a_hung_tool_is_a_tool_error(
    tmp_path, default_model_dir, default_tokenizer
):
    _WaitingCalculator.instances = []
    _WaitingCalculator.others_done = threading.Event()
    _WaitingCalculator.expected_calls = 6 * 2  # six other trajectories' 2 rounds each
    _WaitingCalculator.resets_together = threading.Barrier(8, timeout=5)  # the step's 8 trajectories
    _WaitingCalculator.reset_threads = []
    _WaitingCalculator.timeout = 8.0
    trainer = _train(
        tmp_path,
        "waiting",
        default_model_dir,
        default_tokenizer,
        environment_factory=_WaitingCalculator,
        config=dict(tool_timeout=_WaitingCalculator.timeout),
    )
    _, completions, _, _, calls, failures, _ = trainer.recorded_loop
    assert _WaitingCalculator.others_done.is_set()
    # Each environment was reset once, off the trainer's thread (agents/environment_resets.py).
    assert len(_WaitingCalculator.reset_threads) == 8 and "MainThread" not in _WaitingCalculator.reset_threads
    assert calls == 16 and failures == 1  # 8 trajectories x 2 rounds; the one call past its timeout
    assert logged(trainer, "tools/timeout") == [1.0]
    assert logged(trainer, "tools/raised") == [0.0]
    results = [message["content"] for trajectory in completions for message in trajectory if message["role"] == "tool"]
    assert sum("timed out after 8 s" in content for content in results) == 1
    assert logged(trainer, "agents/tool_rounds_max") == [2.0]
    assert logged(trainer, "agents/later_turns_max_in_flight")[0] >= 2  # turns of several trajectories batched
    # The environment's get_reward is a reward source, as in TRL: the calls each instance made.
    assert logged(trainer, "rewards/_WaitingCalculator/mean") == [2.0]


class _PromptRecordingGRPOTrainer(_RecordingGRPOTrainer):
    def _tool_call_loop(self, prompts, prompt_ids, *args):
        self.recorded_prompt_ids = [list(ids) for ids in prompt_ids]
        return super()._tool_call_loop(prompts, prompt_ids, *args)


def verbose_inc(a: int) -> str:
    """Add one to an integer, and explain at length.

    Args:
        a: The integer.
    """
    return f"{a + 1} " + "because " * 8


def test_a_trajectory_that_would_overflow_the_model_length_stops_inside_it(
    tmp_path, default_model_dir, default_tokenizer
):
    """Tool results that would take a trajectory past its budget: max_completion_length (250) is all the engine's
    context (256) leaves after the 5-token prompts (a longer budget is refused up front, naming
    vllm_max_model_length: reliability/input_checks.py). Every later turn asks at most what is left, a result that
    would not fit is rolled back (the trajectory ends on "budget", TRL's rule), and no request reaches vLLM past its
    model length (which would fail the step)."""
    from transformers import AutoModelForCausalLM

    verbose_inc.__name__ = "inc"  # the structured-outputs regex makes every turn a call of `inc`
    trainer = _PromptRecordingGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
        reward_funcs=length_reward,
        args=_config(tmp_path, "overflow", max_completion_length=250, max_tool_calling_iterations=8),
        train_dataset=inc_dataset(2),
        processing_class=with_tool_template(default_tokenizer),
        tools=[verbose_inc],
    )
    trainer.train()
    tool_mask, completions, completion_ids, _, calls, failures, _ = trainer.recorded_loop
    assert failures == 0 and calls > 0
    lengths = [len(p) + len(c) for p, c in zip(trainer.recorded_prompt_ids, completion_ids, strict=True)]
    assert max(lengths) <= 256, lengths
    assert logged(trainer, "agents/stopped_budget_frac")[0] > 0  # results rolled back at the context's edge
    assert logged(trainer, "agents/stopped_tool_rounds_frac") == [0.0]  # the context ended them, not the rounds
    for mask, ids in zip(tool_mask, completion_ids, strict=True):
        assert len(mask) == len(ids)


def test_tool_scheduling_is_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="tool_scheduling must be one of"):
        small_grpo_config(tmp_path, tool_scheduling="parallel")
    with pytest.raises(ValueError, match="tool_timeout must be positive"):
        small_grpo_config(tmp_path, tool_timeout=0)


@pytest.mark.slow
def test_ranks_with_different_turn_counts_both_finish(tmp_path):
    """2 gloo processes, each with its colocated engine: rank 0's trajectories take 1 turn, rank 1's take 4 (3 tool
    rounds). TRL's loop would have rank 1 call generation three more times than rank 0; the concurrent loop calls no
    collective after the first turn, so both ranks train both steps."""
    import json
    import os
    import subprocess
    import sys

    from .helpers.launch import REPO_ROOT, launch_env

    script = os.path.join(REPO_ROOT, "tests", "distributed", "uneven_tool_turns.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29685"]
    env = dict(launch_env(), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(
        [*command, script, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["steps"] for report in reports] == [2, 2]
    for rollout in reports[0]["rollouts"]:
        assert rollout["calls"] == 0 and set(rollout["turns"]) == {1}
    for rollout in reports[1]["rollouts"]:
        assert rollout["calls"] == 3 * 4 and set(rollout["turns"]) == {7}  # 4 assistant turns + 3 tool results


def test_multi_turn_losses_are_the_same_in_packed_padded_and_shared_prefix_passes(
    tmp_path, default_model_dir, default_tokenizer
):
    """The same multi-turn batch (per-request seeds, so every run samples it) trains to the same loss and gradient norm
    with padded rows, packed rows and the shared-prefix pass: the tool tokens are masked out of the loss and its
    normaliser by TRL's tool_mask, which the packed and shared-prefix passes carry."""
    from transformers import AutoModelForCausalLM

    from trlx_scale.tasks.tool_chat_template import every_turn_calls

    tokenizer = with_tool_template(default_tokenizer)
    tokenizer.response_template = every_turn_calls("inc", "a")  # every turn starting with a digit calls inc(a)

    def inc_text(a: str) -> str:
        """Add one to a number written as text.

        Args:
            a: The number.
        """
        return str(int(a) + 1) if a.isdigit() else "?"

    logs = {}
    for name, overrides in {
        "padded": dict(padding_free=False),
        "packed": dict(padding_free=True),
        "shared_prefix": dict(padding_free=False, shared_prefix="true"),
    }.items():
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
            reward_funcs=lambda completions, **_: [float(len(str(c))) for c in completions],  # differs in a group
            args=small_grpo_config(
                tmp_path / name,
                use_vllm=True,
                vllm_mode="colocate",
                max_steps=1,
                max_completion_length=40,
                vllm_max_model_length=128,
                max_tool_calling_iterations=2,
                **overrides,
            ),
            train_dataset=inc_dataset(2),
            processing_class=tokenizer,
            tools=[inc_text],
        )
        trainer.train()
        logs[name] = (logged(trainer, "loss")[0], logged(trainer, "grad_norm")[0], logged(trainer, "tools/calls")[0])
    assert logs["padded"][2] > 0 and logs["padded"][1] > 0  # a multi-turn batch with a gradient
    for name in ("packed", "shared_prefix"):
        assert logs[name][2] == logs["padded"][2]
        assert logs[name][0] == pytest.approx(logs["padded"][0], rel=1e-4, abs=1e-6)
        assert logs[name][1] == pytest.approx(logs["padded"][1], rel=1e-4)


def test_a_reasoning_gym_task_runs_through_the_trainer_as_a_tool_environment(
    tmp_path, default_model_dir, default_tokenizer
):
    """Reasoning Gym's basic_arithmetic as TRL's environment_factory: every turn of the embedded model (digits)
    submits an answer, the library scores it, and the reward of each trajectory is 1 exactly when one of its
    submissions was answered "correct" (the library's score), else 0."""
    from transformers import AutoModelForCausalLM

    from trlx_scale.agents.reasoning_gym_environment import ReasoningGymEnvironment, reasoning_gym_dataset
    from trlx_scale.tasks.tool_chat_template import every_turn_calls

    rows = reasoning_gym_dataset(
        "basic_arithmetic", size=8, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",)
    )
    environment = ReasoningGymEnvironment()
    environment.reset(**rows[0])
    assert environment.submit("wrong") == "incorrect, try again" and environment.get_reward() == 0.0
    answer = str(eval(rows[0]["prompt"][0]["content"].removeprefix("Calculate ").rstrip(".")))  # noqa: S307
    assert environment.submit(answer) == "correct" and environment.get_reward() == 1.0

    tokenizer = with_tool_template(default_tokenizer)
    tokenizer.response_template = every_turn_calls("submit", "answer")  # each turn starting with a digit submits

    class Recording(_RecordingGRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            self.recorded_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            return self.recorded_rewards

    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
        args=small_grpo_config(
            tmp_path,
            use_vllm=True,
            vllm_mode="colocate",
            max_steps=1,
            max_completion_length=60,
            vllm_max_model_length=128,
            max_tool_calling_iterations=2,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory=ReasoningGymEnvironment,
    )
    trainer.train()
    _, completions, _, _, calls, _, _ = trainer.recorded_loop
    assert calls > 0
    rewards = trainer.recorded_rewards[:, 0].tolist()  # the environment's get_reward, one per trajectory
    for trajectory, reward in zip(completions, rewards, strict=True):
        answered = [m["content"] for m in trajectory if m["role"] == "tool"]
        assert reward == (1.0 if "correct" in answered else 0.0)
