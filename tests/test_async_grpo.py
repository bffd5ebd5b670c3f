"""AsyncGRPOTrainer end to end on CPU with real `vllm serve` subprocesses and the embedded model: max_staleness=0
equals the synchronous GRPOTrainer, the staleness bound and per-version verification hold with full weights and
with LoRA adapters, resume is exact (at max_staleness 0 and 1), two servers share the work as replicas, and the
server faults are errors."""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from trlx_scale.generation.server_client import (
    SamplingSettings,
    ServerFailedError,
    ServerModelMismatchError,
    ServerUnreachableError,
    VLLMServerClient,
)
from trlx_scale.generation.server_weights import write_full_weights
from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess, free_port
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, read_run_summary, run_command, run_torchrun_report
from .helpers.process_rewards import worker_pid_reward
from .helpers.trainers import logged, small_grpo_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_dir):
    """One server for the module's trainers (each sends its own version 0 first, so none sees another's weights)."""
    launch = ServerLaunch(model=default_model_dir, dtype="float32", max_loras=6, max_lora_rank=8)
    process = VLLMServerProcess(launch, startup_timeout=300).start()
    yield process
    process.stop()


def test_the_cpu_server_runs_its_model_in_the_engine_core(server):
    """compat/vllm_cpu_server_executor.py: the model runs in the engine core, with no worker process (whose queue
    reader would spin a core for a second after every step), and the server answers."""
    import httpx
    import psutil

    processes = psutil.Process(server.process.pid).children(recursive=True)
    titles = [" ".join(process.cmdline()) for process in processes]
    assert any("VLLM::EngineCore" in title for title in titles), titles
    assert not any("VLLM::Worker" in title for title in titles), titles
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    answer.raise_for_status()
    assert len(answer.json()["choices"]) == 1
    # Serving a request started no worker either.
    titles = [" ".join(process.cmdline()) for process in psutil.Process(server.process.pid).children(recursive=True)]
    assert not any("VLLM::Worker" in title for title in titles), titles


def _async(
    tmp_path,
    default_model_dir,
    server=None,
    peft_config=None,
    train_size=64,
    reward_funcs=exact_match_reward,
    trainer_class=AsyncGRPOTrainer,
    **overrides,
):
    if server is not None:
        overrides.setdefault("vllm_server_base_url", server.url)
    overrides.setdefault("max_steps", 4)
    args = small_grpo_config(tmp_path / "async", AsyncGRPOConfig, **overrides)
    return trainer_class(
        model=default_model_dir,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=addition_dataset("train", size=train_size),
        peft_config=peft_config,
    )


def test_max_staleness_zero_is_the_synchronous_trainer(server, default_model_dir, tmp_path):
    """Same seeds, same data: the server samples what the colocated engine samples (per-request seeds keyed on the
    step, the group's row and its prompt), so rewards are equal. Losses and gradient norms agree to float rounding:
    the off-policy correction weighs tokens by exp(pi_prox - pi_behave), and the server's and the colocated engine's
    log-probs differ by ~1e-6 (different batch compositions in their kernels)."""
    sync = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(
            tmp_path / "sync", GRPOConfig, max_steps=4, use_vllm=True, vllm_mode="colocate", vllm_dtype="trainer"
        ),
        train_dataset=addition_dataset("train", size=64),
    )
    sync.train()
    overlapped = _async(tmp_path, default_model_dir, server, max_staleness=0)
    overlapped.train()
    assert logged(overlapped, "reward") == logged(sync, "reward")
    assert torch.allclose(torch.tensor(logged(overlapped, "loss")), torch.tensor(logged(sync, "loss")), atol=1e-6)
    assert torch.allclose(
        torch.tensor(logged(overlapped, "grad_norm")), torch.tensor(logged(sync, "grad_norm")), rtol=1e-3, atol=1e-5
    )
    assert logged(overlapped, "async/staleness_max") == [0.0] * 4
    # The colocated engine's vLLM state is process-wide: free it now, not in a garbage collection that may land inside
    # a later engine's start-up (seen after this module grew: "world group is not initialized" in test_grpo_trainer).
    del sync
    gc.collect()


def test_staleness_is_bounded_and_every_version_verified(default_model_dir, tmp_path):
    """No server URL: the trainer starts one, and stops it at the end. With max_staleness=2 the groups of steps
    2-3 come from versions two older; every version sent was verified by the probe (its gap is logged), and each
    row of a rollout carries the version that sampled it."""
    trainer = _async(tmp_path, default_model_dir, max_staleness=2, learning_rate=5e-3)
    seen_versions, weights_dtypes = [], []
    original = trainer._finish_rollout

    def record(batch):
        batch = original(batch)
        seen_versions.append((trainer.state.global_step, batch.policy_version.tolist()))
        weights_dtypes.append(trainer.vllm_generation.weights_dtype)
        return batch

    trainer._finish_rollout = record
    trainer.train()
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0, 2.0, 2.0]
    assert all(gap < 1e-3 for gap in logged(trainer, "sync/probe_logprob_gap"))
    # One process, full weights: each update after the first lands in the background (weight_delivery="auto") and
    # is logged at the next rollout; the last one lands after the last step (checked when train() ends).
    assert logged(trainer, "sync/background") == [0.0, 1.0, 1.0]
    assert seen_versions == [(step, [max(0, step - 2)] * 8) for step in range(4)]
    assert weights_dtypes == [torch.float32] * 4  # the server it started: full weights written in its dtype
    assert len(logged(trainer, "async/sampler_trainer_kl")) == 4
    # The first rollout is sampled by the trainer's own weights: no weight is outside the correction's bounds.
    clipped = logged(trainer, "async/behaviour_weight_clip_frac")
    assert len(clipped) == 4 and clipped[0] == 0.0
    assert trainer.vllm_generation is None  # closed: producer stopped, server stopped


class _NaNAtStepTwo(AsyncGRPOTrainer):
    """The loss of optimizer step 2 is NaN: the non-finite guard skips it."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step + 1 == 2 else loss


def _alternating_reward(completions, **kwargs):
    return [float(index % 2) for index in range(len(completions))]  # a gradient at every step


def test_rows_carry_the_policy_version_a_skipped_step_does_not_advance(server, default_model_dir, tmp_path):
    """max_staleness=1, step 2 skipped by the non-finite guard: rollout r is sampled by rollout r-1's weights, whose
    policy versions are 0, 0, 1, 1 (rollout 2's weights are step 1's: step 2 changed nothing). The rows carry those,
    not the rollout count (0, 0, 1, 2, what they carried before). Their lag behind the trainer's version (0, 1, 0, 1)
    is logged beside the schedule's staleness (0, 1, 1, 1)."""
    trainer = _NaNAtStepTwo(
        model=default_model_dir,
        reward_funcs=_alternating_reward,
        args=small_grpo_config(
            tmp_path / "async", AsyncGRPOConfig, vllm_server_base_url=server.url, max_staleness=1, max_steps=4
        ),
        train_dataset=addition_dataset("train", size=64),
    )
    rows = []
    original = trainer._finish_rollout

    def record(batch):
        batch = original(batch)
        rows.append((trainer.state.global_step, trainer.policy_version, sorted(set(batch.policy_version.tolist()))))
        return batch

    trainer._finish_rollout = record
    trainer.train()
    assert logged(trainer, "reliability/skipped_steps") == [0.0, 1.0, 1.0, 1.0]
    assert trainer.policy_version == 3  # four steps, three updates
    assert rows == [(0, 0, [0]), (1, 1, [0]), (2, 1, [1]), (3, 2, [1])]
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0, 1.0, 1.0]  # rollouts behind
    assert logged(trainer, "async/policy_version_lag_max") == [0.0, 1.0, 0.0, 1.0]  # updates behind


def test_evaluation_samples_with_the_trainers_current_weights(server, default_model_dir, tmp_path):
    """eval_strategy under asynchronous generation (refused before): at the evaluation after step 2 the servers get
    the trainer's current weights (rollout 2's, verified by the probe, sent before the next rollout would send them),
    the held-out prompts are sampled beside the producer's groups, and TRL scores and logs them. Training is
    unchanged by it: the same rewards as a run without evaluation."""

    def run(directory, **evaluation):
        trainer = AsyncGRPOTrainer(
            model=default_model_dir,
            reward_funcs=exact_match_reward,
            args=small_grpo_config(
                directory,
                AsyncGRPOConfig,
                vllm_server_base_url=server.url,
                max_staleness=1,
                max_steps=3,
                learning_rate=5e-3,
                per_device_eval_batch_size=8,
                **evaluation,
            ),
            train_dataset=addition_dataset("train", size=64),
            eval_dataset=addition_dataset("held_out", size=4),
        )
        served_at_evaluation = []
        original = trainer._generate_and_score_completions

        def record(inputs):
            output = original(inputs)
            if not trainer.model.training:
                served_at_evaluation.append((trainer.state.global_step, trainer.vllm_generation.served_version))
            return output

        trainer._generate_and_score_completions = record
        trainer.train()
        return trainer, served_at_evaluation

    evaluated, served = run(tmp_path / "eval", eval_strategy="steps", eval_steps=2)
    # Evaluations after step 2 and after the last step, 3; each of 4 held-out prompts x 4 samples in batches of 8
    # (two rollouts), all sampled by the weights of the step just trained.
    assert served == [(2, 2), (2, 2), (3, 3), (3, 3)]
    evaluations = [entry for entry in evaluated.state.log_history if "eval_reward" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 3]
    # The trainer's current weights: its log-probs of the sampled tokens are the server's (to fp32 rounding), where
    # samples a step old differ by the update (learning_rate 5e-3).
    assert all(entry["eval_sampling/sampling_logp_difference/max"] < 1e-4 for entry in evaluations)
    plain, _ = run(tmp_path / "plain")
    assert logged(evaluated, "reward") == logged(plain, "reward")


def test_an_evaluation_outside_train_stops_what_it_started(server, default_model_dir, tmp_path):
    """trainer.evaluate() before any training builds the engine (producer thread, weights sent) and closes it after,
    as train() does: nothing is left running."""
    trainer = AsyncGRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(
            tmp_path / "async", AsyncGRPOConfig, vllm_server_base_url=server.url, per_device_eval_batch_size=8
        ),
        train_dataset=addition_dataset("train", size=64),
        eval_dataset=addition_dataset("held_out", size=2),
    )
    assert "eval_loss" in trainer.evaluate()
    logged_rewards = [entry["eval_reward"] for entry in trainer.state.log_history if "eval_reward" in entry]
    assert len(logged_rewards) == 1  # TRL logs its reward metrics
    assert trainer.vllm_generation is None
    assert not any(thread.name == "trlx-scale-rollout-producer" for thread in threading.enumerate())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_a_refused_weight_transfer_stops_the_server_the_trainer_started(server, default_model_dir, tmp_path):
    """vllm_server_weight_transfer="nccl" on this CPU machine is refused by name once the engine is built; a server
    the trainer had started for it is stopped, not left behind (the module's server stands in for it)."""
    from trlx_scale.generation.server_weight_transports import NCCLTransportUnavailable

    trainer = _async(tmp_path, default_model_dir, server, vllm_server_weight_transfer="nccl", max_steps=1)
    stopped = []
    trainer.server_start.start = lambda sync_mode: ([server.url], SimpleNamespace(stop=lambda: stopped.append(True)))
    with pytest.raises(NCCLTransportUnavailable, match="no CUDA device"):
        trainer.train()
    assert stopped == [True]


def test_the_loss_that_trains_is_the_decoupled_objective(server, default_model_dir, tmp_path):
    """num_iterations=2 (allowed now: two optimizer steps per rollout), max_staleness=1, loss_type="grpo". On a
    micro-batch of step 4 (rollout 1's second step: sampled by version 0, pi_prox the weights after step 2, pi_theta
    after step 3), the trainer's loss and gradients are those of the decoupled objective's pure function (tests/helpers/) on the
    batch's fields: pi_theta / pi_prox clipped, times pi_prox / pi_behave truncated at the clip bound. Both ratios
    are away from 1 there, so the trust region and the correction both act."""
    from .helpers.decoupled_objective import decoupled_policy_loss

    trainer = _async(
        tmp_path,
        default_model_dir,
        server,
        reward_funcs=_alternating_reward,
        max_staleness=1,
        num_iterations=2,
        max_steps=4,
        learning_rate=5e-3,
        loss_type="grpo",
    )
    assert trainer.args.optimizer_steps_per_rollout == 2 and trainer.vllm_importance_sampling_clip_min is None
    compared = {}
    original = trainer._compute_loss

    def compare(model, inputs):
        loss = original(model, inputs)
        if trainer.state.global_step == 3 and model.training and not compared:
            params = [param for param in model.parameters() if param.requires_grad]
            ours = torch.autograd.grad(loss, params, retain_graph=True)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            length = inputs["completion_ids"].size(1)
            logps = trainer._get_per_token_logps_and_entropies(model, ids, attention, length)[0]
            mask = inputs["completion_mask"]
            prox, behave = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"]
            reference, _ = decoupled_policy_loss(
                logps,
                prox,
                behave,
                inputs["advantages"],
                mask,
                trainer.epsilon_low,
                trainer.epsilon_high,
                weight_cap=trainer.vllm_importance_sampling_clip_max,
                aggregation="sequence_mean",
            )
            theirs = torch.autograd.grad(reference, params)
            real = mask.bool()
            compared.update(
                loss=(loss.item(), reference.item()),
                gradients=[(a, b) for a, b in zip(ours, theirs, strict=True)],
                trust_region=(logps - prox)[real].abs().max().item(),
                correction=(prox - torch.nan_to_num(behave))[real].abs().max().item(),
            )
        return loss

    trainer._compute_loss = compare
    trainer.train()
    assert compared, "step 4 never computed a loss"
    ours, reference = compared["loss"]
    assert abs(ours - reference) < 1e-6, (ours, reference)
    for mine, pure in compared["gradients"]:
        assert torch.allclose(mine, pure, rtol=1e-4, atol=1e-7)
    assert compared["trust_region"] > 1e-4 and compared["correction"] > 1e-4, compared


def test_gspo_weighs_each_sequence_by_the_geometric_mean(server, default_model_dir, tmp_path):
    """Under GSPO the behaviour weight is per sequence; by default (sequence_behaviour_weight="geometric_mean") it is
    exp of the mean token log-ratio, as the decoupled objective's sequence weight, not TRL's product (which an
    unchanged policy's numerics alone push out of the clip bounds on long sequences: benchmarks/gspo_sequence_weight.py).
    From step 2 on, a step stale with learning_rate 5e-3, the two differ."""
    from .helpers.decoupled_objective import behaviour_weights

    trainer = _async(
        tmp_path,
        default_model_dir,
        server,
        reward_funcs=_alternating_reward,  # a gradient at every step: the weights move
        loss_recipe="gspo",
        max_staleness=1,
        max_steps=3,
        learning_rate=5e-3,
    )
    seen = []
    original = trainer._deferred_correction

    def capture(logps, inputs):
        original(logps, inputs)
        if "importance_sampling_ratio" in inputs and trainer.model.training:
            seen.append((logps.detach(), inputs["sampling_per_token_logps"], inputs["completion_mask"].float()))
            seen[-1] += (inputs["importance_sampling_ratio"],)

    trainer._deferred_correction = capture
    trainer.train()
    assert len(seen) >= 2
    differs = False
    for prox, behave, mask, ratio in seen:
        expected, _ = behaviour_weights(prox, behave, mask, "sequence", "truncate", cap=3.0)
        assert ratio.shape == expected.shape and torch.allclose(ratio, expected, atol=1e-6)
        product = torch.exp((torch.nan_to_num(prox - behave) * mask).sum(-1, keepdim=True)).clamp(max=3.0)
        differs = differs or not torch.allclose(product, ratio, atol=1e-4)
    assert differs


class _AgainAndAgain:
    """A gym-style environment: after each answer the user asks again, three turns in all."""

    def reset(self, prompt, **row):
        self.turns = 0
        return None  # the dataset's prompt

    def step(self, message):
        self.turns += 1
        return "again", 0.0, self.turns == 3, {}


def test_multi_turn_trajectories_on_the_server_are_token_in_token_out(
    server, default_model_dir, default_model, default_tokenizer, tmp_path
):
    """Four 3-turn trajectories at once on the real vLLM server (tests/helpers/server_turn_sampler.py): every turn continues
    the held ids, so the behaviour log-probs the server returned for each sampled token are the trainer model's
    log-probs of that token given the whole held sequence (prompt, earlier turns, observations), and the loss mask
    is 1 on exactly the sampled tokens (each turn's end token included) and 0 on the observations."""
    import asyncio

    from trlx_scale.agents import GymEnvironment
    from trlx_scale.agents.multi_turn_rollout import run_trajectories
    from trlx_scale.agents.trajectory_tokens import ObservationRenderer, TurnBudget

    from .helpers.server_turn_sampler import ServerTurnSampler

    base = write_full_weights(default_model, str(tmp_path / "base"))  # the trainers before left their weights
    VLLMServerClient([server.url], model=default_model_dir, sampling=SamplingSettings(4)).reload_weights(0, base)
    sampler = ServerTurnSampler([server.url], model=default_model_dir)
    renderer = ObservationRenderer(default_tokenizer)
    questions = ["12+30=", "7+8=", "41+5=", "3+3="]

    async def rollout():
        try:
            return await run_trajectories(
                prompts=[[{"role": "user", "content": q}] for q in questions],
                rows=[{"answer": "0"}] * 4,
                environments=[GymEnvironment(_AgainAndAgain()) for _ in questions],
                seeds=[11, 12, 13, 14],
                sampler=sampler,
                renderer=renderer,
                parse=lambda ids: {
                    "role": "assistant",
                    "content": default_tokenizer.decode(ids, skip_special_tokens=True),
                },
                budget=TurnBudget(max_completion_length=96, max_model_len=256, max_turn_tokens=8),
                tokenizer=default_tokenizer,
            )
        finally:
            await sampler.aclose()

    trajectories = asyncio.run(rollout())
    observation = renderer.observation_ids([{"role": "user", "content": "again"}])
    for trajectory in trajectories:
        tokens = trajectory.tokens
        assert trajectory.stop_reason in ("done", "length", "budget") and tokens.turns >= 1
        mask = torch.tensor(tokens.loss_mask)
        ids = torch.tensor([tokens.context_ids])
        with torch.no_grad():
            logps = torch.log_softmax(default_model(input_ids=ids).logits[0, :-1].float(), -1)
        start = len(tokens.prompt_ids)
        trainer = logps[start - 1 :].gather(-1, ids[0, start:, None])[:, 0]
        behaviour = torch.tensor(tokens.logprobs)
        assert (trainer - behaviour)[mask.bool()].abs().max().item() < 1e-3
        # Observations: exactly "<|user|>again<|assistant|>" between turns, masked out.
        runs = "".join(str(m) for m in tokens.loss_mask).split("1")
        assert all(len(run) in (0, len(observation)) for run in runs)
        assert mask.sum().item() == len(tokens.loss_mask) - observation.__len__() * (tokens.turns - 1)
    assert sum(t.tokens.turns for t in trajectories) > len(trajectories)  # some went past their first turn


class _FlakyLoggingReward:
    """exact_match_reward with TRL's reward-function arguments checked and used: its first call raises (so the guard
    retries sample by sample) and so does the first retry (one sample fails); every call logs a metric and a column."""

    __name__ = "flaky_reward"

    def __init__(self):
        self.calls, self.states, self._lock = 0, [], threading.Lock()

    def __call__(self, prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **columns):
        with self._lock:  # the scorer runs several groups at once
            call, self.calls = self.calls, self.calls + 1
            self.states.append(trainer_state)
        if call < 2:
            raise ValueError("the verifier timed out")
        log_metric("flaky/samples", float(len(prompts)))
        log_extra("flaky_note", [f"{len(ids)} tokens" for ids in completion_ids])
        return exact_match_reward(completions=completions, **columns)


def test_reward_functions_get_trls_arguments_and_the_guard(server, default_model_dir, tmp_path):
    """As in GRPOTrainer: with reward_errors="skip" a sample whose reward raised scores NaN and the run goes on (it
    stopped before); log_metric's values are logged at the step that trains the group; trainer_state is a snapshot
    taken when the group was admitted (not the live state the trainer moves on); and an infinite reward is refused
    with the function's name, on the rank's next step."""
    from trlx_scale.reliability.reward_guard import RewardFunctionError

    reward = _FlakyLoggingReward()
    trainer = _async(
        tmp_path, default_model_dir, server, reward_funcs=reward, max_staleness=1, max_steps=3, reward_errors="skip"
    )
    trainer.train()
    assert sum(logged(trainer, "reliability/reward_errors")) == 1.0
    # One value per step, from the groups that step trained: the last step's groups were scored whole (4 samples).
    samples = logged(trainer, "flaky/samples")
    assert len(samples) == 3 and samples[-1] == 4.0
    assert "flaky_note" in trainer._logs["extra"]
    assert reward.states and all(state is not trainer.state for state in reward.states)
    # Steps 0-1 were admitted with version 0 (a window of 2) and step 2's groups when version 1 was published: each
    # saw the state of its admission. Groups of a fourth step (scored, never trained) may have been admitted with
    # version 2 before the run stopped, or not: how far the producer got is timing.
    admitted_at = {state.global_step for state in reward.states}
    assert {0, 1} <= admitted_at <= {0, 1, 2}, admitted_at

    def infinite_reward(completions, **kwargs):
        return [float("inf")] + [0.0] * (len(completions) - 1)

    refusing = _async(tmp_path / "inf", default_model_dir, server, reward_funcs=infinite_reward, max_steps=2)
    with pytest.raises(RewardFunctionError, match="infinite_reward' returned inf"):
        refusing.train()


def test_synchronous_rewards_run_in_worker_processes_with_trls_arguments(server, default_model_dir, tmp_path):
    """async_reward_processes=1: the producer's synchronous reward runs in a worker process (the process id it logs
    is not the trainer's), its log_metric / log_extra calls reach the step that trains its group, and the run
    trains on its rewards."""
    trainer = _async(
        tmp_path,
        default_model_dir,
        server,
        reward_funcs=[worker_pid_reward],
        max_staleness=1,
        max_steps=2,
        async_reward_processes=1,
    )
    trainer.train()
    pids = logged(trainer, "worker_pid")
    assert len(pids) == 2 and all(pid != float(os.getpid()) for pid in pids)
    assert "worker_note" in trainer._logs["extra"]
    assert len(logged(trainer, "rewards/worker_pid_reward/mean")) == 2
    assert trainer._reward_processes is not None and trainer._reward_processes._pool is None  # closed with the run


def test_lora_versions_are_adapters_of_their_own(server, default_model_dir, default_model, tmp_path):
    """Only adapters are sent: the server's base must be the trainer's. The trainers before this one reloaded the
    module's server with their weights, so its base is put back first (without that, version 0's probe differs by
    ~0.1 and the run stops: the verification at work)."""
    from peft import LoraConfig

    # The base back, written as the trainers write versions: a checkpoint with tied embeddings omits lm_head, and
    # vLLM's reload would keep the previous trainer's head.
    base = write_full_weights(default_model, str(tmp_path / "base"))
    VLLMServerClient([server.url], model=default_model_dir, sampling=SamplingSettings(4)).reload_weights(0, base)
    trainer = _async(
        tmp_path,
        default_model_dir,
        server,
        peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]),
        max_staleness=1,
        vllm_sync_mode="lora",
        learning_rate=5e-2,
    )
    loaded_counts = []
    original = trainer._finish_rollout

    def record(batch):
        loaded_counts.append(len(trainer.vllm_generation.client.loaded_adapters))
        assert trainer.vllm_generation.weights_dtype is None  # a server it did not start: its dtype is unknown
        return original(batch)

    trainer._finish_rollout = record
    trainer.train()
    assert logged(trainer, "sync/lora_only") == [1.0] * 4
    assert all(gap < 1e-3 for gap in logged(trainer, "sync/probe_logprob_gap"))
    assert max(loaded_counts) <= 1 + 2  # max_staleness + 2 adapters at most; older ones unloaded
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_resume_is_exact(server, default_model_dir, tmp_path, max_staleness):
    """4 straight steps (a checkpoint at step 2) against a new trainer resuming from that checkpoint: the same
    rewards, staleness and losses for steps 3-4. At max_staleness=0 the producer regenerates what was ahead (its
    groups and seeds are functions of the step, sampled by the checkpoint's weights). At 1, step 3's groups were
    sampled by version 1, which the resumed run no longer has: the checkpoint carries them (its rollout window), and
    step 4's are sampled by version 2 in both runs. Without the window, step 3 would be sampled by version 2
    (staleness 0, not 1)."""
    settings = dict(max_staleness=max_staleness, learning_rate=5e-3)
    straight = _async(tmp_path / "a", default_model_dir, server, save_strategy="steps", save_steps=2, **settings)
    straight.train()
    checkpoint = tmp_path / "a" / "async" / "checkpoint-2"
    assert (checkpoint / "async_rollout_window_rank0.pt").is_file()
    resumed = _async(tmp_path / "b", default_model_dir, server, **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(straight, "async/staleness_max") == [0.0] + [float(max_staleness)] * 3
    assert logged(resumed, "async/staleness_max") == logged(straight, "async/staleness_max")
    assert logged(resumed, "reward") == logged(straight, "reward")
    assert len(logged(resumed, "loss")) == 4
    assert torch.allclose(torch.tensor(logged(resumed, "loss")), torch.tensor(logged(straight, "loss")), atol=1e-7)
    assert logged(resumed, "grad_norm")[2:] == pytest.approx(logged(straight, "grad_norm")[2:], rel=1e-5)


def test_dynamic_sampling_replaces_groups_in_the_producer(server, default_model_dir, tmp_path):
    """dynamic_sampling in the async trainer: the producer drops a group whose rewards are all equal and samples its
    slot again (another prompt), so a step trains on groups with signal where any of 3 attempts found one. What TRL
    reports of the batch trained (frac_reward_zero_std) is what the producer could not fill (1 - filled_frac); the
    replacements were sampled by their slots' versions (staleness within the bound); the rows trained are the
    replacements' prompts (the engine checks each group's prompt ids against the trainer's tokenization of them)."""
    trainer = _async(
        tmp_path, default_model_dir, server, max_staleness=1, dynamic_sampling=True, max_steps=4, learning_rate=5e-3
    )
    trainer.train()
    zero_std = logged(trainer, "frac_reward_zero_std")
    filled = logged(trainer, "batch/filled_frac")
    assert len(filled) == 4
    assert zero_std == pytest.approx([1.0 - value for value in filled])
    assert max(logged(trainer, "batch/zero_variance_frac")) > 0  # the task has groups without signal: some dropped
    assert max(logged(trainer, "batch/generation_rounds")) > 1
    assert all(factor >= 1 for factor in logged(trainer, "batch/oversampling_factor"))
    assert max(logged(trainer, "async/staleness_max")) <= 1


def test_dynamic_sampling_resumes_exactly_with_replaced_groups_in_the_window(server, default_model_dir, tmp_path):
    """A checkpoint at step 2 with max_staleness=1 carries step 3's groups, replacements included (their attempts
    saved): the resumed run trains on the same rows and groups, so its rewards, fill and losses are the straight
    run's."""
    settings = dict(max_staleness=1, learning_rate=5e-3, dynamic_sampling=True)
    straight = _async(tmp_path / "a", default_model_dir, server, save_strategy="steps", save_steps=2, **settings)
    straight.train()
    checkpoint = tmp_path / "a" / "async" / "checkpoint-2"
    resumed = _async(tmp_path / "b", default_model_dir, server, **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "reward") == logged(straight, "reward")
    assert logged(resumed, "batch/filled_frac") == logged(straight, "batch/filled_frac")
    assert logged(resumed, "batch/generation_rounds") == logged(straight, "batch/generation_rounds")
    assert max(logged(straight, "batch/generation_rounds")) > 1  # some group was replaced
    assert torch.allclose(torch.tensor(logged(resumed, "loss")), torch.tensor(logged(straight, "loss")), atol=1e-7)


def _finished_requests(url: str) -> float:
    """The requests a vLLM server has finished (its Prometheus counter, every finish reason)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


def test_replicas_share_the_groups_and_every_update(server, default_model_dir, tmp_path):
    """Two servers as data-parallel replicas (a comma-separated vllm_server_base_url): group k goes to replica k mod 2,
    so both sample, equally; every version is sent to both and verified on both (a replica left on older weights fails
    its probe: WeightDeliveryError)."""
    launch = ServerLaunch(model=default_model_dir, dtype="float32", enable_lora=False)
    with VLLMServerProcess(launch, startup_timeout=300) as second:
        urls = [server.url, second.url]
        before = [_finished_requests(url) for url in urls]
        trainer = _async(
            tmp_path, default_model_dir, vllm_server_base_url=",".join(urls), max_staleness=1, learning_rate=5e-3
        )
        trainer.train()
        served = [_finished_requests(url) - count for url, count in zip(urls, before, strict=True)]
    # The last update lands in the background after the last step: verified when train() ends, not logged.
    assert len(logged(trainer, "sync/probe_logprob_gap")) == 3
    assert all(gap < 1e-3 for gap in logged(trainer, "sync/probe_logprob_gap"))
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0, 1.0, 1.0]
    # 8 groups trained (2 per step), 4 per replica, plus 4 probes each; a group is one request of n=4 (counted once
    # or per sample): the replicas differ by at most one group admitted ahead of the end.
    assert min(served) >= 4 + 4
    assert abs(served[0] - served[1]) <= 4


def test_an_unreachable_server_stops_the_run_at_once(default_model_dir, tmp_path):
    trainer = _async(tmp_path, default_model_dir, vllm_server_base_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServerUnreachableError, match="no vLLM server answers"):
        trainer.train()


def test_a_server_of_another_model_is_refused(server, default_model, tmp_path):
    other = tmp_path / "other-model"
    default_model.save_pretrained(other)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(server.launch.model).save_pretrained(other)
    trainer = _async(tmp_path, str(other), server)
    with pytest.raises(ServerModelMismatchError, match="but this trainer trains"):
        trainer.train()


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["cpu_ddp", "cpu_zero3"])
def test_two_processes_train_asynchronously_and_learn(config, server, tmp_path):
    """The async example under `accelerate launch` with 2 processes (DDP; DeepSpeed ZeRO-3, whose weight gathers
    and probe forward are collectives) on the module's server: every version is verified (a failed probe stops the
    run), the staleness stays within the bound, and the policy learns: the reward of the last steps is above that of
    the first ones. (A trainer starting its own server: test_staleness_is_bounded_and_every_version_verified.)"""
    out = tmp_path / "out"
    command = [
        *ACCELERATE_LAUNCH,
        "--config_file",
        os.path.join(REPO_ROOT, "configs", "accelerate", f"{config}.yaml"),
        os.path.join(REPO_ROOT, "examples", "async_grpo.py"),
        "--max_steps",
        "8",
        "--per_device_train_batch_size",
        "32",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--eval_every_steps",
        "0",
        "--max_staleness",
        "2",
        "--output_dir",
        str(out),
        "--vllm_server_base_url",
        server.url,
    ]
    run_command(command, timeout=900)
    summary = read_run_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["staleness_max"] == 2  # max_staleness, reached and never passed
    rewards = summary["reward_curve"]
    assert len(rewards) == 8
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards


@pytest.mark.distributed
def test_two_processes_fill_their_own_slots_with_dynamic_sampling(server, tmp_path):
    """The async example with dynamic_sampling under `accelerate launch` with 2 DDP processes: each rank's producer
    replaces its own groups, both ranks train every step (DDP's gradient all-reduce would hang otherwise), and the
    metrics are every rank's: what TRL reports of the trained batch (frac_reward_zero_std, over both ranks) is what
    the two producers could not fill."""
    import json

    out = tmp_path / "out"
    command = [
        *ACCELERATE_LAUNCH,
        "--config_file",
        os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml"),
        os.path.join(REPO_ROOT, "examples", "async_grpo.py"),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "16",
        "--logging_steps",
        "1",
        "--eval_every_steps",
        "0",
        "--max_staleness",
        "1",
        "--dynamic_sampling",
        "true",
        "--output_dir",
        str(out),
        "--vllm_server_base_url",
        server.url,
    ]
    run_command(command, timeout=900)
    summary = read_run_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    logs = [entry for entry in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in entry]
    assert len(logs) == 3
    assert [entry["frac_reward_zero_std"] for entry in logs] == pytest.approx(
        [1.0 - entry["batch/filled_frac"] for entry in logs]
    )
    assert max(entry["batch/zero_variance_frac"] for entry in logs) > 0


@pytest.mark.distributed
def test_fsdp2_sharded_policies_reach_the_server_verified(server, tmp_path):
    """FSDP2 (raw fully_shard, gloo, 2 processes: Accelerate runs FSDP only on accelerators): the trainer's weight
    path (``ServerGeneration.ensure_version``) gathers the shards tensor by tensor on every rank and the main process
    writes them, for full weights, a LoRA policy merged, and the adapter alone. Version 0's files equal the unsharded
    model's (the merge equal to PEFT's own on one process); versions 0 and 1 are verified on the module's server, and
    the step between them moves the probe by more than the tolerance, so the verification tells them apart."""
    report = run_torchrun_report(
        "async_server_weights_fsdp2.py", tmp_path / "fsdp2.json", port=29672, arguments=[server.url]
    )
    assert sorted(report) == ["full", "lora_adapter", "lora_merged"]
    for name, variant in report.items():
        assert variant["sharded"], name
        assert variant["same_names"] and variant["max_abs_diff"] <= 1e-6, (name, variant)
        assert variant["gap_v0"] < 1e-3 and variant["gap_v1"] < 1e-3, (name, variant)
        assert variant["probe_moved"] > 1e-2, (name, variant)
        assert variant["root_unsharded_at_send"], (name, variant)  # the state a send after a forward meets


def test_a_partial_full_weight_delivery_is_refused_by_name(server, default_model, default_model_dir, tmp_path):
    """Files that lack one tensor leave that parameter on its old weights at the server (vLLM only logs it): the
    reload is refused with the parameter's name (compat/vllm_checked_reload.py); files whose tensor has other values
    than the trainer wrote are refused naming it; and the server keeps serving."""
    import shutil

    from safetensors.torch import load_file, save_file

    from trlx_scale.generation.server_client import PartialDeliveryError

    client = VLLMServerClient([server.url], model=default_model_dir, sampling=SamplingSettings(4))
    whole = write_full_weights(default_model, str(tmp_path / "whole"))
    client.reload_weights(0, whole)
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in os.listdir(whole):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(whole, name))
            del tensors["model.layers.0.mlp.down_proj.weight"]
            save_file(tensors, str(partial / name))
        else:
            shutil.copy(os.path.join(whole, name), partial)
    with pytest.raises(PartialDeliveryError, match=r"kept 1 of its \d+ parameters .*layers\.0\.mlp\.down_proj"):
        client.reload_weights(1, str(partial))
    # Every tensor there, one with other values than the trainer wrote (the file changed after it was written): the
    # fingerprints the server's reload took of what it read name it (weight_fingerprints).
    damaged = tmp_path / "damaged"
    shutil.copytree(whole, damaged)
    tensors = load_file(str(damaged / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"][0, :4] += 0.5
    save_file(tensors, str(damaged / "model.safetensors"))
    with pytest.raises(PartialDeliveryError, match=r"read 1 of the \d+ tensors .*layers\.1\.self_attn\.o_proj"):
        client.reload_weights(1, str(damaged))
    client.reload_weights(0, whole)  # the base back, for the module's later trainers (their values checked too)
    assert len(client.prompt_logprobs([1, 5, 6, 7], 0)[0]) == 3


def test_a_kept_reload_does_not_wait_for_the_requests_in_flight(server, default_model, default_model_dir, tmp_path):
    """full_weight_reload='keep': a reload lands while a long group is being sampled and does not wait for it: the
    group's tokens name the versions that sampled them, the first ones the old weights', the later ones the new
    ones' (vLLM's per-token weight versions; under 'drain' every token would be the old version's), and the group's
    version is its oldest token's. Drain mode's /v1/completions requests still work on the same server. (Whether the
    group's answer arrived before the reload returned is no test of it: under 'drain' the answer is still being
    serialised when the reload ends.)"""
    import asyncio

    from trlx_scale.rollout.async_producer import GroupRequest

    client = VLLMServerClient(
        [server.url], model=default_model_dir, sampling=SamplingSettings(200), keep_requests_on_reload=True
    )
    old = write_full_weights(default_model, str(tmp_path / "v0"))
    client.reload_weights(0, old)
    with torch.no_grad():
        default_model.lm_head.weight.mul_(1.5)  # another version: any visible change of the log-probs
    new = write_full_weights(default_model, str(tmp_path / "v1"))
    request = GroupRequest(index=0, prompt=[1, 5, 6, 7], num_generations=128, version=0, seed=3)

    async def sample_across_a_reload():
        try:
            group = asyncio.create_task(client.sample(request))
            await asyncio.sleep(0.05)  # the group's first tokens come from version 0 (its prefill alone took longer)
            await asyncio.to_thread(client.reload_weights, 1, new)
            return await group
        finally:
            await client.aclose()

    try:
        sampled = asyncio.run(sample_across_a_reload())
    finally:
        client.reload_weights(0, old)  # the base back, for the module's later trainers
    assert len(sampled.token_versions) == 128
    for ids, versions, logprobs in zip(sampled.completion_ids, sampled.token_versions, sampled.logprobs, strict=True):
        assert len(versions) == len(ids) == len(logprobs)
        assert versions == sorted(versions) and set(versions) <= {0, 1}
    assert sampled.version == 0
    assert any(1 in versions for versions in sampled.token_versions)
    drained = VLLMServerClient([server.url], model=default_model_dir, sampling=SamplingSettings(4))
    assert len(drained.prompt_logprobs([1, 5, 6, 7], 0)[0]) == 3


@pytest.mark.parametrize("delivery", ["inline", "background"])
def test_kept_reloads_train_with_every_tokens_policy_version(server, default_model_dir, tmp_path, delivery):
    """The trainer with full_weight_reload='keep' at max_staleness=2: no request hold around a reload, every
    token's policy version reaches the batch (a row's version is its oldest token's, none newer than the trainer's),
    the share of tokens a reload reached mid-completion is logged, and every update is verified as before."""
    # In the background the probe still runs alone on vLLM's CPU build: the kept requests count for its hold (one
    # batched with the probe kills a LoRA-enabled engine, and with it every later test on this server).
    trainer = _async(
        tmp_path, default_model_dir, server, max_staleness=2, full_weight_reload="keep", weight_delivery=delivery
    )
    seen = []
    original = trainer._finish_rollout

    def record(batch):
        batch = original(batch)
        seen.append((trainer.policy_version, batch.policy_version.clone(), batch.token_policy_version.clone()))
        return batch

    trainer._finish_rollout = record
    trainer.train()
    assert len(seen) == 4
    for policy_version, rows, tokens in seen:
        assert tokens.shape[0] == rows.shape[0]
        assert bool((tokens >= rows[:, None]).all()) and bool((tokens <= policy_version).all())
    shares = logged(trainer, "async/tokens_after_update_frac")
    assert len(shares) == 4
    # In the background the last update lands after the last step: checked when train() ends, not logged.
    assert len(logged(trainer, "sync/probe_logprob_gap")) == (4 if delivery == "inline" else 3)
    assert all(gap < 1e-3 for gap in logged(trainer, "sync/probe_logprob_gap"))


def test_a_server_that_dies_mid_run_stops_the_run_with_its_exit(default_model_dir, tmp_path):
    """The trainer's own server is killed after step 2 (as an out-of-memory kill would): the next step fails with
    an error that says the server died and shows its exit, within request_timeout, and nothing is left running."""
    from transformers import TrainerCallback

    from trlx_scale.rollout.async_producer import RolloutProducerError

    trainer = _async(tmp_path, default_model_dir, max_staleness=1, request_timeout=60)
    killed = {}

    class KillServer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                process = trainer.vllm_generation.server_process
                killed["process"] = process
                process.process.kill()

    trainer.add_callback(KillServer())
    with pytest.raises(
        (ServerFailedError, RolloutProducerError), match="died: the server process exited with code -9"
    ):
        trainer.train()
    # The update after step 2 goes in the background (weight_delivery="auto"): the reload fails there and stops the
    # producer; step 3 may still train on the groups version 1 sampled before the kill, never on more.
    assert trainer.state.global_step in (2, 3)
    assert not killed["process"].alive()


class _LossTimes(AsyncGRPOTrainer):
    """Records when each loss pass ran (the trainer's own code runs unchanged)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.loss_times = getattr(self, "loss_times", []) + [time.monotonic()]
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_background_updates_land_while_the_trainer_trains(server, default_model_dir, tmp_path):
    """One process, full weights, max_staleness=2, weight_delivery="background": the servers' side of every
    update after the first (made 0.5 s slower here) runs while the trainer computes its next loss, which needs
    groups older versions sampled; each version still reaches the producer verified (every logged probe gap small,
    staleness as scheduled)."""
    reloads = []
    trainer = _async(
        tmp_path, default_model_dir, server, max_staleness=2, weight_delivery="background", trainer_class=_LossTimes
    )
    original = trainer.engine_builder.build

    def build():
        engine = original()
        reload = engine.client.reload_weights

        def slow_reload(version, path):
            began = time.monotonic()
            time.sleep(0.5)
            result = reload(version, path)
            reloads.append((began, time.monotonic()))  # began: after the hold, when the reload itself starts
            return result

        engine.client.reload_weights = slow_reload
        return engine

    trainer.engine_builder.build = build
    trainer.train()
    assert len(reloads) == 4 and len(trainer.loss_times) == 4
    # Losses computed before each reload ended. Inline, update k lands before step k's loss: 0, 1, 2, 3. In the
    # background the first is inline (nothing trained yet) and step k's loss runs while update k lands: 0, 2, 3, 4.
    assert [sum(t < ended for t in trainer.loss_times) for _, ended in reloads] == [0, 2, 3, 4]
    assert logged(trainer, "sync/background") == [0.0, 1.0, 1.0]
    assert all(gap < 1e-3 for gap in logged(trainer, "sync/probe_logprob_gap"))
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("delivery", "lost_from", "stopped_at"),
    [("inline", 2, (2,)), ("background", 2, (2, 3)), ("background", 3, (3, 4))],
)
def test_weights_that_never_arrive_stop_the_run(server, default_model_dir, tmp_path, delivery, lost_from, stopped_at):
    """From step ``lost_from`` on, the updates are lost on their way (the reload is skipped, as an adapter that is
    never delivered: verl 7495). The probe after the next update finds the server still on the previous weights: the
    run stops with an error naming the version instead of sampling from stale weights. Inline, before the next step;
    in the background, the next step may train on the groups the version before sampled (max_staleness=1) if they
    were scored before the failure stopped the producer, never more, and no group of the lost version is sampled.
    The last update (version 3, landing while the last step trains) fails the run too, at its end."""
    from transformers import TrainerCallback

    from trlx_scale.generation.server_generation import WeightDeliveryError

    trainer = _async(
        tmp_path, default_model_dir, server, max_staleness=1, learning_rate=5e-3, weight_delivery=delivery
    )

    class LoseUpdates(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == lost_from:
                client = trainer.vllm_generation.client
                client.reload_weights = lambda version, path: (0.0, 0.0)

    trainer.add_callback(LoseUpdates())
    with pytest.raises(WeightDeliveryError, match=f"does not serve policy version {lost_from}"):
        trainer.train()
    assert trainer.state.global_step in stopped_at
    assert trainer.vllm_generation is None  # closed: producer stopped


@pytest.mark.distributed
def test_a_fault_on_one_rank_or_at_the_server_stops_every_rank_within_seconds(server, tmp_path):
    """2 processes (DeepSpeed ZeRO-3 on gloo) meet five faults in turn, each injected after step 2 (tests/scripts/
    async_rank_faults.py): a reward function raising on rank 1 only, rank 1's producer crashing, the server
    answering HTTP 500 to the weight update (only the main process sends it), an update acknowledged but never
    applied (the main process's verification fails), the server gone. Before, the rank that did not fail waited in
    the next collective (a barrier, a ZeRO-3 gather, the gradients' all-reduce) until its timeout. Now every rank
    raises the same error (RankFailureError; for the reward, the guard's RewardFunctionError), naming the failing rank
    and its error, seconds after the injection (request_timeout is 300 s: no wait for it). The two weight faults
    again with weight_delivery="background", where the main process's delivery thread meets them while both
    trainers train, after a clean background run (its threads agreeing through the store) that trains to the end.

    Between them, a LoRA policy with adapter-only sync: each sync gathers the adapter's bytes on each rank and
    nothing more (it gathered the whole model), while the full-weight runs gather the whole model."""
    import json

    from .helpers.fault_proxy import FaultProxy

    report = tmp_path / "faults"
    with FaultProxy(server.url) as proxy:
        command = [
            *ACCELERATE_LAUNCH,
            "--config_file",
            os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml"),
            "--main_process_port",
            str(free_port()),
            os.path.join(REPO_ROOT, "tests", "scripts", "async_rank_faults.py"),
            proxy.url,
            str(report),
        ]
        run_command(command, timeout=900)
        injected = list(proxy.injected)
    ranks = [json.loads((tmp_path / f"faults.rank{rank}.json").read_text()) for rank in range(2)]
    # The reward function's failure is the guard's (GRPOTrainer's RewardFunctionError, naming the rank, the sample and
    # the function); the rest are the rank agreement's.
    expected = {
        "reward_rank1": ("RewardFunctionError", "rank 1", "the verifier on rank 1 crashed"),
        "producer_rank1": ("RankFailureError", "rank 1", "rank 1 has no prompt for group"),
        "server_500": ("RankFailureError", "rank 0", "500"),
        "lost_update": ("RankFailureError", "rank 0", "does not serve policy version"),
        "server_500_background": ("RankFailureError", "rank 0", "500"),
        "lost_update_background": ("RankFailureError", "rank 0", "does not serve policy version"),
        "server_dead": ("RankFailureError", "rank", ""),
    }
    background = [rank.pop(5) for rank in ranks]
    for outcome in background:  # every update after the first landed in the background, verified, on both ranks
        assert outcome["fault"] == "background" and outcome["error"] is None and outcome["steps"] == 6, outcome
        # Logged at the rollout after it lands; the last one lands after the last step (checked, not logged).
        assert outcome["background"] == [0.0] + [1.0] * 4, outcome
        assert outcome["staleness"] == [0.0] + [1.0] * 5, outcome
    gaps = background[0]["probe_gaps"]  # the main process's checks
    assert len(gaps) == 5 and all(gap < 1e-3 for gap in gaps), gaps
    lora = [rank.pop(4) for rank in ranks]
    for outcome in lora:
        assert outcome["fault"] == "lora_sync" and outcome["error"] is None and outcome["steps"] == 3, outcome
        assert outcome["gathered_bytes"] == [outcome["adapter_bytes"]] * 3, outcome
        assert outcome["adapter_bytes"] < outcome["model_bytes"] / 50, outcome
    for outcome in (rank[0] for rank in ranks):  # full weights: the whole model, gathered before each send
        assert outcome["gathered_bytes"] and max(outcome["gathered_bytes"]) > outcome["model_bytes"] / 2, outcome
    for on_rank0, on_rank1 in zip(*ranks, strict=True):
        fault = on_rank0["fault"]
        error, failing_rank, words = expected[fault]
        for outcome in (on_rank0, on_rank1):
            assert outcome["error"] == error, (fault, outcome)
            assert f"{failing_rank}" in outcome["message"] and words in outcome["message"], (fault, outcome)
            assert outcome["seconds_after_injection"] < 60, (fault, outcome)
            assert 2 <= outcome["steps"] < 6, (fault, outcome)
        assert on_rank0["message"] == on_rank1["message"], fault  # the same error on every rank
        seconds = [round(outcome["seconds_after_injection"], 1) for outcome in (on_rank0, on_rank1)]
        print(f"{fault}: {seconds} s after the injection, at step {on_rank0['steps']}: {on_rank0['message'][:300]}")
    assert any(line.startswith("500 ") for line in injected) and any(line.startswith("drop ") for line in injected)


def _interrupted_async(output_dir, server, *extra, processes: int = 1) -> list[str]:
    script = os.path.join(REPO_ROOT, "tests", "scripts", "interrupted_run.py")
    arguments = [script, str(output_dir), "--max_steps", "5", "--save_steps", "100", "--async_server", server.url]
    arguments += list(extra)
    if processes == 1:
        return [sys.executable, *arguments]
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml")
    return [*ACCELERATE_LAUNCH, "--config_file", config, "--main_process_port", str(free_port()), *arguments]


def test_preempted_async_run_saves_its_window_and_resumes_exactly(server, tmp_path):
    """SIGTERM after step 2 at max_staleness=1: the step in progress is finished, the groups its checkpoint's window
    needs (sampled by the version before the checkpoint's) are waited for within preemption_grace_period, the run
    exits with 75, and the resumed run repeats the straight one: the same rewards, staleness, losses and gradient
    norms for every step."""
    from trlx_scale.reliability.preemption import PREEMPTED_EXIT_CODE

    from .helpers.launch import run_result, signal_once_progressed

    straight = run_result(_interrupted_async(tmp_path / "straight", server))
    pids = tmp_path / "pids"
    code, output, finished, _ = signal_once_progressed(
        _interrupted_async(tmp_path / "run", server, "--pid_dir", str(pids)), pids, 0, [signal.SIGTERM]
    )
    assert code == PREEMPTED_EXIT_CODE, output[-4000:]
    assert "still in flight" not in output
    resumed = run_result(_interrupted_async(tmp_path / "run", server, "--resume"))
    assert resumed["trained_steps"] == list(range(finished + 1, 6))
    assert resumed["staleness"] == straight["staleness"]
    for step, values in straight["logged"].items():
        assert resumed["logged"][step] == pytest.approx(values, rel=1e-5, abs=1e-7), step


@pytest.mark.distributed
@pytest.mark.parametrize("delivery", ["inline", "background"])
def test_a_preempted_save_does_not_wait_past_its_grace_period(server, tmp_path, delivery):
    """2 processes; rank 1's verifier takes a minute from group 3 on, so when SIGTERM comes after step 2 (max_staleness
    1) rank 1's window (group 3, sampled by version 2) cannot complete. With preemption_grace_period=1 the save
    waits one second, then every rank saves an empty window (the ranks' schedules must agree), the requests and the
    scoring in flight are cancelled, and the run exits with 75 within seconds, not after the minute (nor
    request_timeout's 300 s). The resumed run samples group 3 again from the checkpoint's weights: fresher
    (staleness 0 at the step after the checkpoint, 1 in the interrupted run's schedule), and it finishes. With
    weight_delivery="background" the save also waits for the update in flight within the grace period, the ranks
    agreeing on whether it landed."""
    from trlx_scale.reliability.preemption import PREEMPTED_EXIT_CODE
    from trlx_scale.rollout.rollout_window import load_window

    from .helpers.launch import run_result, signal_once_progressed

    pids = tmp_path / "pids"
    slow = ["--slow_groups_from", "3", "--slow_rank", "1", "--preemption_grace_period", "1"]
    # Steps of 1.5 s at least: the signal, sent right after step 2, lands inside step 3 (a signal that came after
    # step 3's end would be acted on at step 4's, which waits for group 3's minute-long scoring first).
    slow += ["--slow_steps", "1.5", "--weight_delivery", delivery]
    code, output, finished, seconds = signal_once_progressed(
        _interrupted_async(tmp_path / "run", server, "--pid_dir", str(pids), *slow, processes=2),
        pids,
        0,
        [signal.SIGTERM],
    )
    assert code != 0, output[-4000:]  # the launcher reports its workers' exit code 75 as a failure
    # The first worker to exit with 75 is the launcher's root cause; the other exits with 75 too unless the launcher
    # stopped it first (it SIGTERMs the workers left once one has exited non-zero; whether it beats the second
    # worker's own exit is timing). That both ranks saved the step is checked below, from their windows.
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in output, output[-4000:]
    exit_codes = re.findall(r"exitcode  : (-?\d+)", output)
    assert set(exit_codes) <= {str(PREEMPTED_EXIT_CODE), str(-signal.SIGTERM)}, output[-4000:]
    assert finished == 3, output[-4000:]  # the step in progress when the signal came
    assert "were still in flight after the 1 s grace period" in output
    print(f"preempted at step {finished}: exited {seconds:.1f} s after the SIGTERM (grace period 1 s)")
    checkpoint = tmp_path / "run" / f"checkpoint-{finished}"
    for rank in range(2):
        settings, groups = load_window(str(checkpoint / f"async_rollout_window_rank{rank}.pt"))
        assert groups == [] and settings["oldest_version"] == finished, (rank, settings)
    resumed = run_result(
        _interrupted_async(tmp_path / "run", server, "--resume", "--weight_delivery", delivery, processes=2)
    )
    assert resumed["trained_steps"] == list(range(finished + 1, 6))
    assert resumed["staleness"][str(finished + 1)] == 0.0


# ---------------------------------------------------------------- tools and environments (issue #39)
class _Lookup:
    """A TRL ``environment_factory`` environment, unchanged from what GRPOTrainer takes: ``reset(**row)``, one tool,
    ``get_reward``. Its first call in the run hangs past ``tool_timeout`` (the model reads a tool error); each instance
    records the thread its ``reset`` ran on."""

    instances: list = []
    hung = threading.Event()

    def __init__(self):
        _Lookup.instances.append(self)
        self.reset_threads: list[str] = []

    def reset(self, **row):
        self.reset_threads.append(threading.current_thread().name)
        self.calls = 0

    def lookup(self, q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        self.calls += 1
        if not _Lookup.hung.is_set():
            _Lookup.hung.set()
            time.sleep(4)  # past tool_timeout: abandoned, its result dropped
        return "r" * (1 + len(q) % 5)

    def get_reward(self) -> float:
        return float(self.calls)


class _RecordingAsyncTrainer(AsyncGRPOTrainer):
    """Keeps what TRL's tool loop and the collector's reward stage returned (the trainer's own code runs
    unchanged)."""

    def _tool_call_loop(self, *args):
        self.loops = getattr(self, "loops", []) + [super()._tool_call_loop(*args)]
        return self.loops[-1]

    def _rollout_rewards(self, *args):
        self.rewards = getattr(self, "rewards", []) + [super()._rollout_rewards(*args)]
        return self.rewards[-1]


def _tool_tokenizer(default_tokenizer, tool: str, argument: str):
    from trlx_scale.tasks.tool_chat_template import every_turn_calls, with_tool_template

    tokenizer = with_tool_template(default_tokenizer)
    tokenizer.response_template = every_turn_calls(tool, argument)  # each turn starting with a digit is a call
    return tokenizer


def test_tool_trajectories_run_in_the_producer_token_in_token_out(
    server, default_model_dir, default_tokenizer, tmp_path
):
    """AsyncGRPOTrainer with a TRL environment_factory environment (agents/server_tool_sampler.py): the producer
    resets each trajectory's environment off the trainer's thread and runs its tool turns on the server; what TRL's
    loop returns is token-in/token-out (the first turn as sampled, then each tool result rendered alone by TRL's own
    _get_tool_suffix_ids with mask 0, each later turn mask 1); at max_staleness=0 the server's log-probs of every
    sampled token are the trainer's; a hung tool is a tool error; the environment's get_reward is each trajectory's
    reward (its number of calls). Under full_weight_reload='keep': the same through vLLM's token-in/token-out
    endpoint."""
    from datasets import Dataset

    _Lookup.instances.clear()
    _Lookup.hung.clear()
    trainer = _RecordingAsyncTrainer(
        model=default_model_dir,
        args=small_grpo_config(
            tmp_path / "tools",
            AsyncGRPOConfig,
            vllm_server_base_url=server.url,
            max_steps=2,
            max_staleness=0,
            max_completion_length=60,
            max_tool_calling_iterations=3,
            tool_timeout=1.0,
            # Every turn through the token-in/token-out endpoint, each token tagged with its version.
            full_weight_reload="keep",
        ),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i + 3}"}]} for i in range(8)]),
        processing_class=_tool_tokenizer(default_tokenizer, "lookup", "q"),
        environment_factory=_Lookup,
    )
    trainer.train()
    # At max_staleness=0 no group is in flight at a reload: no token was sampled by newer weights than its turn's.
    assert logged(trainer, "async/tokens_after_update_frac") == [0.0, 0.0]
    assert sum(logged(trainer, "tools/timeout")) == 1.0
    # No reset runs on the trainer's thread: the producer's pool is reset off it, and TRL's own instances (drawn by
    # its rollout, then unused) are not reset at all (agents/environment_resets.py).
    producer_made = [env for env in _Lookup.instances if env.reset_threads]
    assert not any("MainThread" in env.reset_threads for env in _Lookup.instances)
    assert len(producer_made) < len(_Lookup.instances)  # TRL drew instances of its own
    assert producer_made and len(producer_made) <= 8  # the pool: at most the trajectories in flight at once
    rounds = 0
    for (masks, completions, completion_ids, logprobs, calls, _, _), rewards in zip(
        trainer.loops, trainer.rewards, strict=True
    ):
        # A call whose result would overflow max_completion_length is rolled back (TRL's rule) but was made.
        assert calls == sum(rewards[:, 0].tolist()) >= sum(m["role"] == "tool" for c in completions for m in c)
        for mask, messages, ids, values, reward in zip(
            masks, completions, completion_ids, logprobs, rewards[:, 0].tolist(), strict=True
        ):
            assert len(mask) == len(ids) == len(values)
            tool_messages = [m for m in messages if m["role"] == "tool"]
            assert reward >= float(len(tool_messages))
            # The masked runs are exactly the rendered tool results, in order; everything else was sampled.
            expected, position = [], 0
            runs = [i for i, bit in enumerate(mask) if bit == 0]
            for message in tool_messages:
                suffix = trainer._get_tool_suffix_ids([message])
                start = runs[position]
                assert ids[start : start + len(suffix)] == suffix, message
                assert all(values[i] == 0.0 for i in range(start, start + len(suffix)))
                expected += list(range(start, start + len(suffix)))
                position += len(suffix)
            assert runs == expected
            rounds += len(tool_messages)
    assert rounds > len(trainer.loops)  # later turns happened
    assert max(logged(trainer, "sampling/sampling_logp_difference/max")) < 1e-3
    assert max(logged(trainer, "async/sampler_trainer_kl")) < 1e-3  # tool tokens are not behaviour samples


def test_a_reasoning_gym_task_runs_through_the_async_trainer(server, default_model_dir, default_tokenizer, tmp_path):
    """Reasoning Gym's basic_arithmetic as TRL's environment_factory under AsyncGRPOTrainer (max_staleness=1): every
    turn of the embedded model (digits) submits an answer, the library scores it, and each trajectory's reward is 1
    exactly when one of its submissions was answered "correct"."""
    from datasets import Dataset

    from trlx_scale.agents.reasoning_gym_environment import ReasoningGymEnvironment, reasoning_gym_dataset

    rows = reasoning_gym_dataset(
        "basic_arithmetic", size=16, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",)
    )
    trainer = _RecordingAsyncTrainer(
        model=default_model_dir,
        args=small_grpo_config(
            tmp_path / "gym",
            AsyncGRPOConfig,
            vllm_server_base_url=server.url,
            max_steps=2,
            max_staleness=1,
            max_completion_length=60,
            max_tool_calling_iterations=2,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=_tool_tokenizer(default_tokenizer, "submit", "answer"),
        environment_factory=ReasoningGymEnvironment,
    )
    trainer.train()
    assert sum(loop[4] for loop in trainer.loops) > 0
    for loop, rewards in zip(trainer.loops, trainer.rewards, strict=True):
        for trajectory, reward in zip(loop[1], rewards[:, 0].tolist(), strict=True):
            answered = [m["content"] for m in trajectory if m["role"] == "tool"]
            assert reward == (1.0 if "correct" in answered else 0.0)


class _RecordingGymTrainer(AsyncGRPOTrainer):
    """Keeps what TRL's rollout returned and scored (the trainer's own code runs unchanged)."""

    def _generate(self, prompts):
        self.generations = getattr(self, "generations", []) + [super()._generate(prompts)]
        return self.generations[-1]

    def _rollout_rewards(self, rows, *args):
        self.scored = getattr(self, "scored", []) + [(list(rows), super()._rollout_rewards(rows, *args))]
        return self.scored[-1][1]


def test_gym_episodes_run_in_the_producer(server, default_model_dir, default_tokenizer, tmp_path):
    """rollout_func=GymRollout(...) under AsyncGRPOTrainer (max_staleness=1): the producer runs each group's episodes
    on the server, its environments reset from the group's row; every episode passes the same checks as
    GRPOTrainer's (helpers/gym_episodes.check_episodes: masks, per-step rewards discounted, the environment's own
    reward, the trajectory handed to the reward functions), and the behaviour log-probs are the trainer's."""
    from datasets import Dataset

    from trlx_scale.agents.gym_rollout import GymRollout

    from .helpers.gym_episodes import BUDGETS, DISCOUNT, ROWS, AskAgain, check_episodes, count_messages

    with pytest.raises(ValueError, match="takes rollout_func=GymRollout"):
        AsyncGRPOTrainer(
            model=default_model_dir,
            args=small_grpo_config(tmp_path / "x", AsyncGRPOConfig),
            rollout_func=lambda prompts, trainer: {},
            reward_funcs=count_messages,
        )
    trainer = _RecordingGymTrainer(
        model=default_model_dir,
        reward_funcs=count_messages,
        args=small_grpo_config(
            tmp_path / "gym",
            AsyncGRPOConfig,
            vllm_server_base_url=server.url,
            max_steps=2,
            max_staleness=1,
            **BUDGETS,
        ),
        train_dataset=Dataset.from_list(ROWS * 4),
        processing_class=default_tokenizer,
        rollout_func=GymRollout(AskAgain, turn_reward_discount=DISCOUNT),
    )
    trainer.train()
    done = 0
    for generation, (inputs, rewards) in zip(trainer.generations, trainer.scored, strict=True):
        done += check_episodes(default_tokenizer, inputs, generation, rewards)
    assert done >= 8
    assert logged(trainer, "async/staleness_max") == [0.0, 1.0]
    assert min(logged(trainer, "agents/turns_mean")) > 1.0
    assert max(logged(trainer, "sampling/sampling_logp_difference/max")) < 1e-3
    assert max(logged(trainer, "async/sampler_trainer_kl")) < 1e-3  # observations are not behaviour samples


def _flat_on_even_rows(completion_ids, flat, **kwargs) -> list[float]:
    """No signal on the rows marked flat (a constant), a function of the completion's tokens on the others."""
    return [0.5 if is_flat else (sum(ids) % 97) / 97 for ids, is_flat in zip(completion_ids, flat, strict=True)]


def test_dynamic_sampling_replaces_tool_trajectories_with_their_prompts_rows(
    server, default_model_dir, default_tokenizer, tmp_path
):
    """tools=[lookup] on the server, half the prompts without signal: the producer replaces their trajectories with
    trajectories of other prompts, and the trainer trains on the replacements' rows (TRL's tool loop renders those
    prompts; the engine checks their token ids against the producer's). A filled step's rows are all from prompts
    with signal; TRL's frac_reward_zero_std of the trained batch is what the producer could not fill."""
    from datasets import Dataset

    def lookup(q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        return "r" * (1 + len(q) % 5)

    class Recording(AsyncGRPOTrainer):
        def _finish_rollout(self, batch):
            self.trained_flat.append([row["flat"] for row in batch.rows])
            return super()._finish_rollout(batch)

    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i + 3}"}], "flat": i % 2 == 0} for i in range(16)]
    trainer = Recording(
        model=default_model_dir,
        reward_funcs=_flat_on_even_rows,
        args=small_grpo_config(
            tmp_path / "tools",
            AsyncGRPOConfig,
            vllm_server_base_url=server.url,
            max_steps=3,
            max_staleness=1,
            max_completion_length=40,
            max_tool_calling_iterations=2,
            dynamic_sampling=True,
            dynamic_sampling_max_rounds=4,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=_tool_tokenizer(default_tokenizer, "lookup", "q"),
        tools=[lookup],
    )
    trainer.trained_flat = []
    trainer.train()
    filled = logged(trainer, "batch/filled_frac")
    assert logged(trainer, "frac_reward_zero_std") == pytest.approx([1.0 - value for value in filled])
    assert max(logged(trainer, "batch/zero_variance_frac")) > 0 and max(logged(trainer, "batch/generation_rounds")) > 1
    for step_filled, flat in zip(filled, trainer.trained_flat, strict=True):
        assert sum(flat) / len(flat) == pytest.approx(1.0 - step_filled)  # the unfilled slots are the flat rows
    assert max(logged(trainer, "tools/call_frequency")) > 0  # the trajectories did call the tool


class _Observing:
    def reset(self, **row):
        return "an observation"

    def get_reward(self) -> float:
        return 0.0

    def lookup(self, q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        return q


def test_what_the_async_trainer_cannot_do_with_tools_is_refused_by_name(
    server, default_model_dir, default_tokenizer, tmp_path
):
    """Evaluation with tools and rollout_func are refused at construction; an environment whose reset returns an
    observation (a group's prompt is sampled once, before environments are drawn) stops the run with the fix."""
    from datasets import Dataset

    from trlx_scale.rollout.async_producer import RolloutProducerError

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+1"}]} for i in range(8)])
    tokenizer = _tool_tokenizer(default_tokenizer, "lookup", "q")

    def build(name, environment_factory=_Lookup, **overrides):
        extra = {"rollout_func": overrides.pop("rollout_func")} if "rollout_func" in overrides else {}
        args = small_grpo_config(tmp_path / name, AsyncGRPOConfig, vllm_server_base_url=server.url, **overrides)
        return AsyncGRPOTrainer(
            model=default_model_dir,
            args=args,
            train_dataset=dataset,
            eval_dataset=dataset if args.eval_strategy != "no" else None,
            processing_class=tokenizer,
            environment_factory=environment_factory,
            **extra,
        )

    with pytest.raises(ValueError, match="does not evaluate yet: set eval_strategy='no'"):
        build("eval", eval_strategy="steps", eval_steps=1)
    with pytest.raises(ValueError, match="takes rollout_func=GymRollout"):
        build("rollout", rollout_func=lambda prompts, trainer: {})
    trainer = build("observing", environment_factory=_Observing, max_steps=1)
    with pytest.raises(RolloutProducerError, match="reset returned an observation"):
        trainer.train()


class _SlowLookup:
    """A deterministic environment whose tool takes 0.2 s: at a checkpoint, trajectories are waiting on it."""

    def reset(self, **row):
        self.calls = 0

    def lookup(self, q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        self.calls += 1
        time.sleep(0.2)
        return "r" * (1 + len(q) % 5)

    def get_reward(self) -> float:
        return float(self.calls)


@pytest.mark.slow
def test_resume_is_exact_with_tool_trajectories_in_flight(
    server, default_model_dir, default_model, default_tokenizer, tmp_path
):
    """Tools under AsyncGRPOTrainer at max_staleness=1 with LoRA (every turn of a trajectory on its first turn's
    adapter, so a run is a function of its seed): 4 straight steps with a checkpoint at step 2, against a new trainer
    resuming from it. Step 3's trajectories, sampled by version 1 and in flight at the save, come back from the
    checkpoint's rollout window; step 4's are sampled again by version 2. Same rewards, tool calls and losses."""
    from datasets import Dataset
    from peft import LoraConfig

    # The module server's base back to the default model (the trainers before this one reloaded full weights).
    base = write_full_weights(default_model, str(tmp_path / "base"))
    VLLMServerClient([server.url], model=default_model_dir, sampling=SamplingSettings(4)).reload_weights(0, base)

    def trainer(name: str) -> AsyncGRPOTrainer:
        return AsyncGRPOTrainer(
            model=default_model_dir,
            args=small_grpo_config(
                tmp_path / name,
                AsyncGRPOConfig,
                vllm_server_base_url=server.url,
                vllm_sync_mode="lora",
                max_staleness=1,
                max_steps=4,
                learning_rate=5e-2,
                max_completion_length=60,
                max_tool_calling_iterations=3,
                save_strategy="steps",
                save_steps=2,
            ),
            train_dataset=Dataset.from_list(
                [{"prompt": [{"role": "user", "content": f"{i}+{i + 3}"}]} for i in range(16)]
            ),
            processing_class=_tool_tokenizer(default_tokenizer, "lookup", "q"),
            environment_factory=_SlowLookup,
            peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]),
        )

    straight = trainer("a")
    straight.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert (checkpoint / "async_rollout_window_rank0.pt").is_file()
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(straight, "async/staleness_max") == [0.0, 1.0, 1.0, 1.0]
    assert sum(logged(straight, "tools/calls")) > 0
    for name in ("reward", "tools/calls", "async/staleness_max"):
        assert logged(resumed, name) == logged(straight, name), name
    assert logged(resumed, "loss") == pytest.approx(logged(straight, "loss"), abs=1e-7)
