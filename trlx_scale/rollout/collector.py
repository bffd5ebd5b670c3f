"""``RolloutCollector``: one rollout of a process, from its dataset rows to its ``RolloutBatch``.

Every trlx_scale RL trainer (``GRPOTrainer``, ``PPOTrainer``, ``AsyncGRPOTrainer``) collects its rollouts here
(``collect``), and online DPO its samples and their rewards (``sample_and_score``: stages 1, 2 and 5, from which
``dpo/online.py`` builds its preference pairs). Each trainer supplies the stages that depend on its
engine (``RolloutSource``: the prompts, the engine's samples, the scorer's rewards); the collector runs them in one
order for all. In order:

1. prompts: the rows' prompts; with ``environment_factory`` each row's environment drawn from TRL's pool and reset
   (at once, or one after another under ``tool_scheduling="lockstep"``), its observation appended to the prompt
   (``trainer._rollout_prompts``);
2. samples: the trainer's engine, driven by TRL's generation driver ``_generate`` (the colocated engine at staleness
   0 in ``GRPOTrainer``; the producer's groups from the servers inside the staleness window in
   ``AsyncGRPOTrainer``), with the engine's log-probs of the sampled tokens (pi_behave) and the tool mask;
3. tensors: prompts left-padded, completions right-padded, truncated completions masked
   (``mask_truncated_completions``), the token count of the loss;
4. log-prob passes (``trainer._get_per_token_logps_and_entropies``: the run's pass, padded, packed or shared-prefix):
   the old (proximal) policy's where the loss needs them and cannot take them from its own pass
   (``_defers_old_logprobs``), then vLLM's importance-sampling weights pi_prox / pi_behave
   (``losses.vllm_importance_sampling``, the package's one place for them), and the reference's for a KL term;
5. rewards: ``trainer._calculate_rewards``, trlx_scale's scorer (TRL's arguments, the functions concurrently, the
   guard), or in ``AsyncGRPOTrainer`` the rewards its producer scored with that scorer; every process's rows;
6. advantages: ``rollout.group_advantages``;
7. the rollout's metrics and completion logs, as TRL logs them; the ``RolloutBatch``, tagged with the policy version
   the engine served (the asynchronous trainer's ``_finish_rollout`` tags each row, or each token, with its own).

What stays TRL's, and why:

- the generation driver ``_generate`` (chat template, response parsing, TRL's tool-call loop, a ``rollout_func``'s
  contract, the completion metrics): the engines and trlx_scale's tool loops plug into it through
  ``_generate_single_turn`` and ``_tool_call_loop``, so a script's chat template, tools and rollout function behave
  as they do under TRL;
- the loss (``_compute_loss``) and the optimizer loop (``Trainer``);
- rollouts with image inputs (a vision-language model): TRL's ``_generate_and_score_completions`` whole, since the
  processor's pixel inputs, tiles and token-type ids are model-specific; the trainer types their batch afterwards.

Nothing here lives beyond one ``collect`` call: the collector is built per rollout, and the values of one stage reach
the next as arguments, not trainer attributes. TRL's own per-batch state that its generation driver reads
(``environments``, the per-rollout tool dicts) is written where TRL would write it (``_rollout_prompts``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from accelerate.utils import gather_object
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, nanstd, pad, use_adapter

from ..compat import trl_trainer_state as trl_state
from ..losses.vllm_importance_sampling import importance_sampling_statistics, vllm_importance_sampling_ratio
from .batch import RolloutBatch
from .group_advantages import group_advantages
from .pass_at_k import group_pass_at_k, is_binary

# The keys of TRL 1.16's rollout dict, in its order (TRL sizes its micro-batch chunks by the first tensor).
TRL_KEY_ORDER = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
)


@dataclass
class RolloutSamples:
    """What the sampling stage returns: TRL's generation driver's values, named (``_generate``'s tuple), and what
    an engine that sampled ahead of the trainer knows of them.

    ``groups``: the producer's scored groups these samples are (``AsyncGRPOTrainer``: their rewards were scored off the
    training loop), None for samples generated for this rollout; ``policy_versions``: each row's policy version (None:
    every row has the rollout's); ``token_policy_versions``: each completion token's, where a weight update can land
    inside a completion (``full_weight_reload="keep"``)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None
    completions: list
    sampling_logps: list[list[float]] | None
    extra_fields: dict[str, Any]
    images: list | None
    tool_images: list | None
    groups: list | None = None
    policy_versions: list[int] | None = None
    token_policy_versions: list[list[int]] | None = None


@dataclass
class ScoredSamples:
    """What ``RolloutCollector.sample_and_score`` returns: the rollout's prompts and samples, and every process's
    rewards per function ``rewards_per_func`` (B_all, F: rows of process 0 first, as TRL gathers them), tagged with
    the policy version the engine served."""

    prompts: list
    samples: RolloutSamples
    rewards_per_func: torch.Tensor
    policy_version: int
    process_index: int = 0

    @property
    def local_rewards_per_func(self) -> torch.Tensor:
        """This process's rows of ``rewards_per_func``."""
        rows = len(self.samples.completion_ids)
        return self.rewards_per_func[self.process_index * rows : (self.process_index + 1) * rows]


class RolloutSource(Protocol):
    """The stages a trainer supplies to the collector (each trainer samples on its own engine and scores with the
    package's scorer): its rows' prompts, the engine's samples, and every process's rewards of them."""

    accelerator: Any  # the run's Accelerator (the process index tags the scored samples)

    def _rollout_prompts(self, rows: list[dict[str, Any]]) -> list: ...

    def _sample_rollout(self, prompts: list, rows: list[dict[str, Any]]) -> RolloutSamples: ...

    def _rollout_rewards(self, rows: list[dict[str, Any]], prompts: list, samples: RolloutSamples) -> torch.Tensor: ...


class RolloutCollector:
    """Collects one rollout for ``trainer``; see the module docstring. ``collect`` (every stage) needs a trlx_scale
    ``GRPOTrainer`` or subclass; ``sample_and_score`` needs only the ``RolloutSource`` stages (online DPO).

    Built per rollout and dropped after it (it holds the trainer; a trainer -> collector -> trainer cycle would leave
    a finished trainer's engine to the cyclic garbage collector)."""

    def __init__(self, trainer: RolloutSource):
        self.trainer = trainer

    def sample_and_score(self, rows: list[dict[str, Any]], policy_version: int) -> ScoredSamples:
        """Stages 1, 2 and 5 only: the samples of ``rows`` and their rewards, for an algorithm that builds its own
        training examples from them (online DPO's preference pairs) instead of a policy-gradient batch."""
        prompts, samples = self.sample(rows)
        rewards_per_func = self.score(rows, prompts, samples)
        return ScoredSamples(
            prompts=prompts,
            samples=samples,
            rewards_per_func=rewards_per_func,
            policy_version=policy_version,
            process_index=self.trainer.accelerator.process_index,
        )

    def collect(self, rows: list[dict[str, Any]], policy_version: int) -> RolloutBatch:
        """The rollout of ``rows`` (this process's dataset rows, each group's ``num_generations`` copies together);
        ``policy_version``: the version the engine serves for it (a row's own where the samples name one)."""
        prompts, samples = self.sample(rows)
        return self.build(rows, prompts, samples, policy_version, lambda: self.score(rows, prompts, samples))

    def build(
        self,
        rows: list[dict[str, Any]],
        prompts: list,
        samples: RolloutSamples,
        policy_version: int,
        rewards: Callable[[], torch.Tensor],
    ) -> RolloutBatch:
        """Stages 3 to 7 on samples already drawn: ``rewards()`` gives every process's rewards (B_all, F), asked for
        where the reward stage runs (``collect`` scores then; dynamic sampling has scored the groups it kept)."""
        trainer = self.trainer
        device = trainer.accelerator.device
        mode = "train" if trainer.model.training else "eval"
        completions, completion_ids_list = samples.completions, samples.completion_ids
        tensors = self._padded(
            samples.prompt_ids, completion_ids_list, samples.sampling_logps, samples.tool_mask, device
        )
        loss_mask = tensors["completion_mask"] * tensors.get("tool_mask", 1)
        num_items_in_batch = trainer.accelerator.gather(loss_mask.sum()).sum()
        old_logps, ratio, ref_logps = self._policy_passes(tensors, loss_mask, mode)

        rewards_per_func = rewards()
        num_generations = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        scored = group_advantages(
            rewards_per_func,
            trainer.reward_weights,
            num_generations,
            trainer.scale_rewards,
            trainer.multi_objective_aggregation,
        )
        start = trainer.accelerator.process_index * len(prompts)
        advantages = scored.advantages[start : start + len(prompts)]

        self._log(mode, prompts, completions, rewards_per_func, scored)
        if ratio is not None:
            log_importance_sampling(
                trainer,
                trl_state.metrics(trainer, mode),
                old_logps,
                tensors["sampling_per_token_logps"],
                ratio,
                loss_mask,
            )

        extras = {"num_items_in_batch": num_items_in_batch}
        if ratio is not None:
            extras["importance_sampling_ratio"] = ratio
        if "tool_mask" in tensors:
            extras["tool_mask"] = tensors["tool_mask"]
        if samples.policy_versions is not None:  # rows sampled by several versions (asynchronous generation)
            policy_version = torch.tensor(samples.policy_versions, dtype=torch.long, device=device)
        present = {"advantages": advantages, "old_per_token_logps": old_logps, "ref_per_token_logps": ref_logps}
        present.update(tensors, **extras)
        return RolloutBatch(
            prompt_ids=tensors["prompt_ids"],
            prompt_mask=tensors["prompt_mask"],
            completion_ids=tensors["completion_ids"],
            completion_mask=tensors["completion_mask"],
            advantages=advantages,
            rewards_per_func=rewards_per_func,
            policy_version=policy_version,
            process_index=trainer.accelerator.process_index,
            old_per_token_logps=old_logps,
            sampling_per_token_logps=tensors.get("sampling_per_token_logps"),
            ref_per_token_logps=ref_logps,
            token_policy_version=self._token_versions(samples, policy_version, tensors["completion_ids"]),
            extras=extras,
            rows=rows,
            _key_order=[key for key in TRL_KEY_ORDER if present.get(key) is not None],
        )

    # ---------------------------------------------------------------- stages 1 and 2: prompts, samples
    def sample(self, rows: list[dict[str, Any]]) -> tuple[list, RolloutSamples]:
        trainer = self.trainer
        prompts = trainer._rollout_prompts(rows)
        samples: RolloutSamples = trainer._sample_rollout(prompts, rows)
        if samples.images is not None:
            raise RuntimeError(
                "the rollout collector got image inputs back from generation; rollouts with images run through TRL's "
                "_generate_and_score_completions (GRPOTrainer routes them there)."
            )
        return prompts, samples

    # ---------------------------------------------------------------- stage 5: rewards
    def score(self, rows: list[dict[str, Any]], prompts: list, samples: RolloutSamples) -> torch.Tensor:
        """(B_all, F): every process's rewards per function (the trainer's ``_rollout_rewards``)."""
        # A rollout_func's extra fields join the rows (its reward functions read them as columns, as under TRL).
        for index, row in enumerate(rows):
            for key, values in samples.extra_fields.items():
                if not isinstance(values, list):
                    row[key] = values
                elif index < len(values):
                    row[key] = values[index]
        return self.trainer._rollout_rewards(rows, prompts, samples)

    @staticmethod
    def _token_versions(samples: RolloutSamples, versions, completion_ids: torch.Tensor) -> torch.Tensor | None:
        """(B, C): each completion token's policy version, padding the row's own; None where the samples have none."""
        if samples.token_policy_versions is None:
            return None
        rows = versions if isinstance(versions, torch.Tensor) else torch.full((completion_ids.size(0),), versions)
        per_token = rows.to(device=completion_ids.device, dtype=torch.long)[:, None].repeat(1, completion_ids.size(1))
        for row, tokens in enumerate(samples.token_policy_versions):
            tokens = tokens[: per_token.size(1)]
            per_token[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return per_token

    # ---------------------------------------------------------------- stage 3: tensors
    def _padded(self, prompt_ids, completion_ids, sampling_logps, tool_mask, device) -> dict[str, torch.Tensor]:
        trainer = self.trainer
        pad_id, multiple = trl_state.tokenizer(trainer).pad_token_id, trainer.pad_to_multiple_of

        def padded(rows: list, value, side: str) -> torch.Tensor:
            return pad(rows, padding_value=value, padding_side=side, pad_to_multiple_of=multiple).to(device=device)

        prompts = [torch.tensor(ids) for ids in prompt_ids]
        completions = [torch.tensor(ids) for ids in completion_ids]
        tensors = {
            "prompt_ids": padded(prompts, pad_id, "left"),
            "prompt_mask": padded([torch.ones_like(ids, dtype=torch.long) for ids in prompts], 0, "left"),
            "completion_ids": padded(completions, pad_id, "right"),
            "completion_mask": padded([torch.ones_like(ids, dtype=torch.long) for ids in completions], 0, "right"),
        }
        if sampling_logps is not None:
            # vLLM reports a token it could not score as None: NaN here, a ratio of 1 in the correction.
            rows = [torch.tensor([float("nan") if x is None else x for x in logps]) for logps in sampling_logps]
            tensors["sampling_per_token_logps"] = padded(rows, 0.0, "right")
        if tool_mask is not None:
            tensors["tool_mask"] = padded([torch.tensor(mask) for mask in tool_mask], 1, "right")
        if trainer.mask_truncated_completions:  # a completion cut at the length limit is left out of the loss
            ends = [*trainer.eos_token_ids, pad_id]
            finished = torch.tensor([ids[-1] in ends for ids in completion_ids], device=device).unsqueeze(1).int()
            tensors["completion_mask"] = tensors["completion_mask"] * finished
            if "tool_mask" in tensors:
                tensors["tool_mask"] = tensors["tool_mask"] * finished
        return tensors

    # ---------------------------------------------------------------- stage 4: log-prob passes
    def _policy_passes(self, tensors: dict, loss_mask: torch.Tensor, mode: str):
        """(old log-probs or None, vLLM's importance-sampling weights or None, reference log-probs or None)."""
        trainer, args = self.trainer, self.trainer.args
        input_ids = torch.cat([tensors["prompt_ids"], tensors["completion_ids"]], dim=1)
        attention_mask = torch.cat([tensors["prompt_mask"], tensors["completion_mask"]], dim=1)
        keep = tensors["completion_ids"].size(1)
        batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size

        def logps(model) -> torch.Tensor:
            return trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, keep, batch_size=batch_size
            )[0]

        correction = trainer.use_vllm and trainer.vllm_importance_sampling_correction
        # The old policy's log-probs: needed when the loss's passes may run with other weights than the ones that
        # sampled (generation and optimizer steps not aligned), or for vLLM's correction; not when the loss pass
        # runs with the sampling weights and provides them itself (_defers_old_logprobs).
        generate_every = args.steps_per_generation * trainer.num_iterations
        needs_old = args.gradient_accumulation_steps % generate_every != 0 or correction
        old = ratio = ref = None
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
            if needs_old and not trainer._defers_old_logprobs():
                old = logps(trainer.model)
                if correction:
                    ratio = vllm_importance_sampling_ratio(
                        old,
                        tensors["sampling_per_token_logps"],
                        loss_mask,
                        trainer.vllm_importance_sampling_mode,
                        trainer.vllm_importance_sampling_clip_min,
                        trainer.vllm_importance_sampling_clip_max,
                        trainer._sequence_weight_normalisation(),
                    )
            if trainer.beta != 0.0:
                if trainer.ref_model is not None:
                    ref = logps(trainer.ref_model)
                else:  # a LoRA policy: its base (adapters off), or the copy named "ref" of an adapter trained again
                    model = trainer.accelerator.unwrap_model(trainer.model)
                    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                        ref = logps(trainer.model)
        return old, ratio, ref

    # ---------------------------------------------------------------- stage 7: metrics and logs
    def _log(self, mode: str, prompts: list, completions: list, rewards_per_func: torch.Tensor, scored) -> None:
        """TRL's rollout metrics and completion logs: the reward per function, the weighted reward, the groups with no
        signal; the prompts, completions, rewards and advantages; what reward functions logged (``log_extra``,
        ``log_metric``), gathered in sorted key order so that every rank gathers the same thing at the same time."""
        trainer = self.trainer
        metrics, logs = trl_state.metrics(trainer, mode), trl_state.reward_logs(trainer)
        for index, name in enumerate(trainer.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, index]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, index]).item())
        metrics["reward"].append(torch.nanmean(scored.rewards).item())
        metrics["reward_std"].append(nanstd(scored.rewards).item())
        metrics["frac_reward_zero_std"].append(scored.is_std_zero.float().mean().item())
        if mode == "eval" and is_binary(scored.rewards):
            group_size = trainer.num_generations_eval
            for k, value in group_pass_at_k(scored.rewards, group_size, tuple(sorted({1, group_size}))).items():
                metrics[f"pass@{k}"].append(value)
        logs["prompt"].extend(gather_object(prompts))
        logs["completion"].extend(gather_object(completions))
        for index, name in enumerate(trainer.reward_func_names):
            logs["rewards"][name].extend(rewards_per_func[:, index].tolist())
        logs["advantages"].extend(scored.advantages.tolist())
        pending_extra, pending_metrics = trl_state.pending_logs(trainer)
        for column in sorted(set(gather_object(list(pending_extra)))):
            logs["extra"][column].extend(gather_object(pending_extra.get(column, [None] * len(prompts))))
        pending_extra.clear()
        device = trainer.accelerator.device
        for name in sorted(set(gather_object(list(pending_metrics)))):
            values = pending_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)
            total, count = trainer.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            metrics[name].append(total / count)
        pending_metrics.clear()


def log_importance_sampling(trainer: Any, metrics: dict, old, sampling, ratio, mask) -> None:
    """TRL's ``sampling/*`` metrics (the gap between the trainer's and the engine's log-probs, and the weights), from
    the rollout's correction or the loss pass's deferred one: each rank's statistics in one gather (rows: ranks), then
    each reduced across ranks as TRL reduces it. Every rank calls it at the same point."""
    stats = importance_sampling_statistics(old, sampling, ratio, mask, trainer.vllm_importance_sampling_mode)
    ranks = trainer.accelerator.gather(torch.stack(list(stats.values())).unsqueeze(0)).reshape(-1, len(stats))
    per_rank = dict(zip(stats, ranks.unbind(dim=1), strict=True))
    metrics["sampling/sampling_logp_difference/mean"].append(per_rank["gap_mean"].mean().item())
    metrics["sampling/sampling_logp_difference/max"].append(per_rank["gap_max"].max().item())
    metrics["sampling/importance_sampling_ratio/min"].append(nanmin(per_rank["ratio_min"]).item())
    metrics["sampling/importance_sampling_ratio/mean"].append(per_rank["ratio_mean"].nanmean().item())
    metrics["sampling/importance_sampling_ratio/max"].append(nanmax(per_rank["ratio_max"]).item())
