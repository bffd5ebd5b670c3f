"""Drop-in contract with TRL: fails when a TRL name we subclass, override or rely on disappears or changes."""

import dataclasses
import inspect
import re

import pytest
import trl
from trl.generation.vllm_generation import VLLMGeneration

import trlx_scale
from trlx_scale import AsyncGRPOTrainer, DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.generation.colocated_generation import ColocatedVLLMGeneration

# TRL's methods each trlx_scale class overrides (its own methods are not pinned: renaming them is trlx_scale's
# business). The test fails when one disappears or changes signature upstream, and when a class starts to override
# a TRL method (on purpose or by a name clash): pin it here then.
TRL_OVERRIDES = {
    GRPOTrainer: {
        "_calculate_rewards",
        "_compute_loss",
        "_generate_and_score_completions",
        "_generate_single_turn",
        "_get_per_token_logps_and_entropies",
        "_prepare_inputs",
        "_tool_call_loop",
        "train",
    },
    DPOTrainer: {"_compute_loss", "_precompute_ref_logps", "_prepare_dataset", "train"},
    PPOTrainer: {"_compute_loss", "_load_from_checkpoint", "create_optimizer"},
    ColocatedVLLMGeneration: {"_init_vllm", "generate", "sync_weights"},
    AsyncGRPOTrainer: {
        "_generate_and_score_completions",
        "_generate_single_turn",
        "_tool_call_loop",
        "evaluate",
        "train",
    },
}


def _parameters(func):
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


CONFIGS = ((GRPOConfig, trl.GRPOConfig), (DPOConfig, trl.DPOConfig), (PPOConfig, trl.GRPOConfig))


def test_top_level_api_is_trainers_and_configs_only():
    assert set(trlx_scale.__all__) == {
        "AsyncGRPOConfig", "AsyncGRPOTrainer", "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig",
        "PPOTrainer", "__version__",
    }  # fmt: skip
    with pytest.raises(AttributeError, match="addition_dataset"):
        trlx_scale.addition_dataset  # noqa: B018 - the demo harness lives in trlx_scale.tasks, not at the top


def test_public_names():
    assert issubclass(trlx_scale.GRPOTrainer, trl.GRPOTrainer)
    assert issubclass(trlx_scale.GRPOConfig, trl.GRPOConfig)
    assert issubclass(trlx_scale.DPOTrainer, trl.DPOTrainer)
    assert issubclass(trlx_scale.DPOConfig, trl.DPOConfig)


def test_trainer_constructor_matches_trl():
    assert _parameters(GRPOTrainer.__init__) == _parameters(trl.GRPOTrainer.__init__)
    assert _parameters(AsyncGRPOTrainer.__init__) == _parameters(trl.GRPOTrainer.__init__)
    # DPO: TRL's parameters in TRL's order, then reward_funcs (online DPO), optional.
    ours = _parameters(DPOTrainer.__init__)
    assert ours[:-1] == _parameters(trl.DPOTrainer.__init__)
    assert ours[-1][0] == "reward_funcs" and ours[-1][2] is None


# TRL fields trlx_scale replaces, with trlx_scale's default: TRL 1.16's DPOConfig.padding_free is a bool its trainer
# switches off ("temporarily unavailable"); trlx_scale's is the packing setting of every trainer, TRL's bool with None
# for the measured default (docs/benchmarks.md; a plain trl.DPOConfig means False: padded rows).
REPLACED_FIELDS = {trl.DPOConfig: {"padding_free": None}}


@pytest.mark.parametrize(("ours_cls", "trl_cls"), CONFIGS)
def test_config_has_every_trl_field_with_the_same_default(ours_cls, trl_cls):
    ours = {f.name: f for f in dataclasses.fields(ours_cls)}
    for theirs in dataclasses.fields(trl_cls):
        assert theirs.name in ours, theirs.name
        if theirs.name in REPLACED_FIELDS.get(trl_cls, {}):
            # A field trlx_scale gives a meaning of its own (docs/defaults.md); a plain TRL config means TRL's.
            assert ours[theirs.name].default == REPLACED_FIELDS[trl_cls][theirs.name], theirs.name
            assert theirs.default is False, "TRL changed its padding_free default: revisit PackingFields"
            continue
        assert ours[theirs.name].default == theirs.default, theirs.name
        assert ours[theirs.name].default_factory == theirs.default_factory, theirs.name


@pytest.mark.parametrize(("ours_cls", "trl_cls"), CONFIGS)
def test_added_config_fields_have_help(ours_cls, trl_cls):
    trl_names = {f.name for f in dataclasses.fields(trl_cls)}
    added = [f for f in dataclasses.fields(ours_cls) if f.name not in trl_names]
    assert added, f"trlx_scale adds fields to {ours_cls.__name__}"
    for f in added:
        assert len(f.metadata.get("help", "")) > 20, f"{f.name} needs a help text"
        # argparse %-formats help strings: a bare "%" breaks every example's --help.
        assert "%" not in f.metadata["help"].replace("%%", ""), f"{f.name}: write 'percent', not '%'"


def test_overridden_methods_exist_upstream_with_the_same_signature():
    # (ours, TRL's class, the class whose signature ours must keep: AsyncGRPOTrainer's parent is our GRPOTrainer)
    triples = (
        (GRPOTrainer, trl.GRPOTrainer, trl.GRPOTrainer),
        (DPOTrainer, trl.DPOTrainer, trl.DPOTrainer),
        (PPOTrainer, trl.GRPOTrainer, trl.GRPOTrainer),
        (ColocatedVLLMGeneration, VLLMGeneration, VLLMGeneration),
        (AsyncGRPOTrainer, trl.GRPOTrainer, GRPOTrainer),
    )
    for ours, trl_cls, parent in triples:
        for name in sorted(TRL_OVERRIDES[ours]):
            assert callable(vars(ours).get(name)), f"{ours.__name__}.{name} is pinned but no longer overridden"
            assert hasattr(trl_cls, name), f"{trl_cls.__name__}.{name} disappeared upstream"
            assert _parameters(vars(ours)[name]) == _parameters(getattr(parent, name)), f"{name} changed signature"
        overriding = {
            name
            for name, member in vars(ours).items()
            if callable(member) and not name.startswith("__") and hasattr(trl_cls, name)
        }
        assert overriding <= TRL_OVERRIDES[ours], (
            f"{ours.__name__} now overrides {trl_cls.__name__}'s {sorted(overriding - TRL_OVERRIDES[ours])}: "
            "pin them in TRL_OVERRIDES, or rename ours if the clash is unintended"
        )


def test_trainer_features_override_trainer_methods_that_still_exist():
    """TrainerFeatures overrides these transformers.Trainer methods, each delegating to a component (and the
    components' callbacks listen to these events): each must still exist upstream with the parameters it forwards."""
    from transformers import Trainer, TrainerCallback

    from trlx_scale.trainer_features import TrainerFeatures

    overridden = (
        "training_step", "log", "compute_loss", "evaluate", "create_optimizer", "_get_grad_norm",
        "_load_from_checkpoint", "_load_best_model", "train", "_finalize_training", "_save_checkpoint",
        "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "init_hf_repo", "_save", "save_model",
        "create_model_card", "push_to_hub", "_push_from_checkpoint",
    )  # fmt: skip
    ours_upstream = {
        name for name, member in vars(TrainerFeatures).items() if callable(member) and hasattr(Trainer, name)
    } - {"__init__"}
    assert ours_upstream == set(overridden), "pin a new override here (or rename a clash)"
    for name in overridden:
        assert hasattr(Trainer, name), f"Trainer.{name} disappeared upstream"
        theirs = [p.name for p in inspect.signature(getattr(Trainer, name)).parameters.values()]
        ours = [p.name for p in inspect.signature(getattr(TrainerFeatures, name)).parameters.values()]
        positional = [n for n in ours if n not in ("args", "kwargs")]
        assert theirs[: len(positional)] == positional, f"TrainerFeatures.{name}: {ours} vs {theirs}"
    for event in ("on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_train_begin"):
        assert hasattr(TrainerCallback, event)
    # transformers' save_model pushes unless _internal_call (the Hub push relies on the flag to save only).
    assert "_internal_call" in inspect.signature(Trainer.save_model).parameters
    assert hasattr(Trainer, "_finish_current_push")  # the Hub push waits on checkpoint uploads with it


def test_transformers_still_pickles_the_whole_arguments_where_the_hub_mixin_rewrites_them():
    """The Hub push rewrites training_args.bin after Trainer._save and replaces Trainer._push_from_checkpoint
    because both pickle ``self.args`` (tokens included) under this name: if transformers stops (or renames the
    file), the rewrite can go."""
    from transformers import Trainer, trainer

    from trlx_scale.hub import secrets

    assert trainer.TRAINING_ARGS_NAME == secrets.TRAINING_ARGS_NAME
    for method in (Trainer._save, Trainer._push_from_checkpoint):
        assert "torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))" in inspect.getsource(method)


def test_the_profiled_methods_and_the_wrapped_signatures_still_exist_upstream():
    """TrainerFeatures wraps training_step and log with transformers' own parameters, and compute_loss so that every
    way TRL/transformers call it still binds; the methods the trainers time must still exist upstream."""
    from transformers import Trainer

    from trlx_scale.trainer_features import TrainerFeatures

    for name in ("training_step", "log"):
        assert _parameters(getattr(TrainerFeatures, name)) == _parameters(getattr(Trainer, name)), name
    for parent in (trl.GRPOTrainer, trl.DPOTrainer):
        upstream = inspect.signature(parent.compute_loss)
        call = upstream.bind(None, "model", "inputs", *[p.default for p in list(upstream.parameters.values())[3:]])
        inspect.signature(TrainerFeatures.compute_loss).bind(*call.args, **call.kwargs)
    for name in (
        "_prepare_inputs",
        "_calculate_rewards",
        "_generate_single_turn",
        "_get_per_token_logps_and_entropies",
    ):
        assert hasattr(trl.GRPOTrainer, name), name
    for name in ("_precompute_ref_logps", "_compute_loss"):
        assert hasattr(trl.DPOTrainer, name), name


def test_vllm_generation_constructor_still_takes_what_we_pass():
    passed = {
        "model", "accelerator", "processing_class", "mode", "structured_outputs_regex", "tensor_parallel_size",
        "gpu_memory_utilization", "max_model_length", "max_num_seqs", "enable_sleep_mode", "model_impl",
        "trust_remote_code", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "max_completion_length", "logprobs", "generation_kwargs",
    }  # fmt: skip
    assert passed <= set(inspect.signature(VLLMGeneration.__init__).parameters)
    # TRL's helper our engine reuses to turn vLLM outputs into per-token log-probs.
    from trl.generation.vllm_generation import extract_logprobs

    assert list(inspect.signature(extract_logprobs).parameters) == ["all_outputs"]
    # Attributes of TRL's engine our subclass reads or sets.
    source = inspect.getsource(VLLMGeneration)
    for attribute in (
        "self._llm_weights_sleeping",
        "self.tp_group",
        "def _iter_named_params",
        "def _fix_param_name_to_vllm",
        "self._dist = DistributedBackend(accelerator)",
        "self.llm",
    ):
        assert attribute in source, attribute


def test_trl_init_uses_use_vllm_only_where_we_replay_it():
    """Our trainer hides use_vllm from TRL's __init__ (so TRL starts no engine) and replays what it would have done:
    the VESPO check and the engine construction. A new use of use_vllm in TRL's __init__ must be mirrored."""
    source = inspect.getsource(trl.GRPOTrainer.__init__)
    uses = [line.strip() for line in source.splitlines() if re.search(r"\buse_vllm\b", line)]
    assert uses == [
        '"`use_transformers_continuous_batching` does not support multimodal models. Use `use_vllm` instead."',
        "self.use_vllm = args.use_vllm",
        'if self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:',
        "if self.use_vllm:",
    ], uses
    assert "self._last_loaded_step = -1" in source
    # The generation paths find the engine through these names.
    loss_source = inspect.getsource(trl.GRPOTrainer._compute_loss)
    # GSPO-token relies on TRL's token branch being exactly this difference of the log-probs it got from
    # _get_per_token_logps_and_entropies (see GRPOTrainer._compute_loss).
    assert "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(" in loss_source
    assert "log_ratio = per_token_logps - old_per_token_logps" in loss_source
    assert (
        'if self.importance_sampling_level == "token":\n            log_importance_weights = log_ratio' in loss_source
    )
    # The seams: _finish_rollout gets the rewards TRL computes inside _generate_and_score_completions, and the loss
    # pass's log-probs come from _get_per_token_logps_and_entropies, called by _compute_loss; TRL reads
    # importance_sampling_level only in _compute_loss (GSPO-token maps to its "token" branch once, at start).
    score_source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "self._calculate_rewards(" in score_source
    uses = [
        name
        for name, member in vars(trl.GRPOTrainer).items()
        if callable(member) and "self.importance_sampling_level" in inspect.getsource(member)
    ]
    assert sorted(uses) == ["__init__", "_compute_loss"], uses
    generation_source = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.sync_weights()" in generation_source
    assert "self._last_loaded_step" in generation_source


def test_engine_copies_of_trl_init_vllm_still_match_trl():
    """_init_vllm is ours (TRL builds vllm.LLM inline); what it copies from TRL 1.16's colocate branch must still be
    TRL's, and every argument TRL gives vllm.LLM must be one ours gives too."""
    import ast
    import textwrap

    source = textwrap.dedent(inspect.getsource(VLLMGeneration._init_vllm))
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LLM"
    ]
    assert len(calls) == 1
    trl_arguments = {keyword.arg for keyword in calls[0].keywords}
    ours = inspect.getsource(ColocatedVLLMGeneration.llm_kwargs)
    missing = [name for name in trl_arguments if f"{name}=" not in ours]
    assert not missing, f"TRL now passes {missing} to vllm.LLM: mirror them in ColocatedVLLMGeneration.llm_kwargs"
    for line in (
        "torch.distributed.new_subgroups_by_enumeration(",
        'os.environ["RANK"] = str(accelerator.process_index)',
        'os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)',
        'os.environ["WORLD_SIZE"] = str(accelerator.num_processes)',
        "ensure_master_addr_port()",
        "accelerator.wait_for_everyone()",
    ):
        assert line in source, line


def test_trl_generate_drives_the_llm_the_way_grouped_llm_expects():
    """GroupedLLM stands in for vllm.LLM inside TRL's colocate generate: one row per completion (n=1) through
    llm.generate(rows, sampling_params=..., use_tqdm=False); wake_up/sleep only around it."""
    source = inspect.getsource(VLLMGeneration.generate)
    assert '"n": 1,  # vLLM on each GPU generates only 1 in colocate mode' in source
    assert "self.llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)" in source
    llm_calls = sorted(set(re.findall(r"self\.llm\.(\w+)\(", source)))
    assert llm_calls == ["generate", "sleep", "wake_up"], llm_calls
    assert "extract_logprobs(all_outputs)" in source and "output.prompt_token_ids" in source


def test_the_rollout_collector_still_mirrors_trls_rollout():
    """rollout/collector.py and rollout/group_advantages.py build the batch TRL 1.16's _generate_and_score_completions
    builds (tests/test_rollout_collector.py compares the two on the same samples). This pins the lines they mirror, so
    that a TRL that changes its rollout is noticed here even where the comparison's two configurations do not reach:
    when the old-policy pass runs, vLLM's correction (losses/vllm_importance_sampling.py), the advantages, the loss's
    token count, a rollout function's fields, the keys of the batch; and that the loss reads the correction after its
    log-prob pass (where the deferred correction puts it)."""
    from trlx_scale.rollout.collector import TRL_KEY_ORDER

    source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    flat = re.sub(r"\s+", " ", source)
    for line in (
        "generate_every = self.args.steps_per_generation * self.num_iterations",
        "if self.args.gradient_accumulation_steps % generate_every != 0 or ( self.use_vllm and "
        "self.vllm_importance_sampling_correction ):",
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
        "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
        "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
        "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)",
        "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()",
        "is_truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids_list], device=device)",
        "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
        "advantages = advantages / (std_rewards + 1e-4)",
        "reward_k = (grouped - mean_k) / (std_k + 1e-4)",
        "advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)",
        "advantages = torch.nan_to_num(advantages, nan=0.0)",
        "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)",
        "inp[key] = values[i]",
        "for column in sorted(set(gather_object(list(self._pending_extra_logs)))):",
        "for name in sorted(set(gather_object(list(self._pending_metrics)))):",
    ):
        assert line in flat, line
    outputs = re.findall(r'output\["(\w+)"\] = ', source) + re.findall(r'^\s+"(\w+)": \w+,$', source, re.M)
    text_keys = [key for key in dict.fromkeys(outputs) if key in TRL_KEY_ORDER]
    assert sorted(text_keys) == sorted(TRL_KEY_ORDER), text_keys
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    logps_at = loss.index("self._get_per_token_logps_and_entropies(")
    ratio_at = loss.index('per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]')
    assert logps_at < ratio_at


def test_trl_still_forces_reentrant_checkpointing_for_peft_under_zero3():
    """GRPOTrainer._shared_prefix_blocker refuses the shared pass for PEFT + ZeRO-3 + gradient checkpointing because
    TRL forces use_reentrant=True there (a DeepSpeed bug breaks the non-reentrant recompute with partitioned frozen
    weights). When TRL drops that guard, this fails: then check the combination and lift the refusal."""
    source = re.sub(r"\s+", " ", inspect.getsource(trl.GRPOTrainer.__init__))
    guard = (
        "if ( is_peft_model(model) and args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3 "
        "and args.gradient_checkpointing ):"
    )
    assert guard in source
    assert 'args.gradient_checkpointing_kwargs["use_reentrant"] = True' in source[source.index(guard) :]


def test_trl_rollout_lines_the_async_trainer_relies_on():
    """AsyncGRPOTrainer (async_grpo/trainer.py) hands TRL completions and rewards through these calls: TRL
    must still sync through `sync_weights()` and generate through `generate(prompts=..., num_generations=...)`, keep
    the top-1 log-prob of each token, tokenize prompts in `_tokenize_prompts`, gather rewards across processes in
    `_calculate_rewards`, and sample prompts with the RepeatSampler the producer replays (rollout/prompt_stream.py)."""
    generation = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.sync_weights()" in generation
    assert "prompts=prompt_ids," in generation and "num_generations=num_generations," in generation
    assert "logprobs = [[lp[0] for lp in seq] for seq in logprobs]" in generation
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in inspect.getsource(
        trl.GRPOTrainer._generate
    )
    rewards = inspect.getsource(trl.GRPOTrainer._calculate_rewards)
    assert "rewards_per_func = gather(rewards_per_func)\n        return rewards_per_func" in rewards
    sampler = re.sub(r"\s+", " ", inspect.getsource(trl.GRPOTrainer._get_train_sampler))
    for line in (
        "mini_repeat_count=self.num_generations,",
        "batch_size=self.args.generation_batch_size // self.num_generations,",
        "repeat_count=self.num_iterations * self.args.steps_per_generation,",
        "seed=self.args.seed,",
    ):
        assert line in sampler, line


def test_the_concurrent_tool_loop_keeps_trls_tool_call_loop_contract():
    """GRPOTrainer's tool loop replaces TRL's _tool_call_loop: same arguments, the same 7 values returned, the same
    per-rollout tool dicts read, and TRL's _generate still the one caller."""

    assert _parameters(GRPOTrainer._tool_call_loop) == _parameters(trl.GRPOTrainer._tool_call_loop)
    loop = inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    assert (
        "return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images"
        in loop
    )
    assert "self._sync_tool_dicts[idx_with_tool]" in loop and "self._async_tool_dicts[idx_with_tool]" in loop
    assert "self._get_tool_suffix_ids(tool_messages)" in loop
    assert "self._tool_call_loop(" in inspect.getsource(trl.GRPOTrainer._generate)


def test_trl_still_keeps_its_environments_and_tools_as_the_collector_prepares_them():
    """compat/trl_rollout_environments.py writes the per-batch state TRL's rollout writes before generating (its pool
    draw, the tool dicts, the observations), and TRL's generation driver must still read it from there."""
    from trlx_scale.compat import trl_rollout_environments

    assert trl_rollout_environments.supported(), f"checked on TRL 1.16, not {trl.__version__}"
    source = re.sub(r"\s+", " ", inspect.getsource(trl.GRPOTrainer._generate_and_score_completions))
    for line in (
        'prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]',
        'self._batch_environments = [x.get("environment") if self._multi_environment else None for x in inputs]',
        "pool = self._environment_pool[name]",
        "if index == len(pool): pool.append(self.environment_factories[name]())",
        "self.environments.append(pool[index])",
        'if member_name not in ("reset", "get_reward") and not member_name.startswith("_")',
        "for tool in self._standalone_tools + methods:",
        "if inspect.iscoroutinefunction(tool): async_tool_dict[tool.__name__] = tool",
        'reset_kwargs = {k: v for k, v in x.items() if k != "environment"} if self._multi_environment else x',
        "observation = environment.reset(**reset_kwargs)",
        'if isinstance(observation, list) and isinstance(content, str): content = [{"type": "text", "text": content}]',
        'if isinstance(observation, str) and isinstance(content, list): observation = [{"type": "text", "text": '
        "observation}]",
        'prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]',
    ):
        assert line in source, line
    driver = inspect.getsource(trl.GRPOTrainer._generate) + inspect.getsource(trl.GRPOTrainer._tokenize_prompts)
    assert "self._batch_environments" in driver and "self._env_tools" in driver
    assert "self._sync_tool_dicts[idx_with_tool]" in inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    assert "self.environments" in inspect.getsource(trl.GRPOTrainer._calculate_rewards)


class _EngineServingGroups:
    """A server engine's stand-in: each generate hands out groups, recorded in the generation call."""

    def __init__(self, groups):
        self.groups = groups

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        from trlx_scale.compat.trl_generation_call import record_served_groups

        record_served_groups(self.groups)
        return list(prompts), [[5, 6]] * len(prompts), [[[-0.5], [-0.25]]] * len(prompts), None


def test_trls_generation_driver_runs_inside_the_generation_call(default_model_dir, tmp_path):
    """compat/trl_generation_call.py: TRL's own ``_generate`` runs its engine (through ``_generate_single_turn``) and a
    ``rollout_func`` on the caller's thread, so the generation call bound around it is theirs: the rows reach a
    ``rollout_func`` and the groups a server engine hands out reach the sampling stage."""
    from trl import GRPOConfig as TRLGRPOConfig

    from trlx_scale.compat.trl_generation_call import (
        current_generation_call,
        generation_call,
        record_served_groups,
        served_groups,
    )
    from trlx_scale.tasks import addition_dataset

    from .helpers.trainers import small_grpo_config

    trainer = trl.GRPOTrainer(
        model=default_model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=small_grpo_config(tmp_path, TRLGRPOConfig),
        train_dataset=addition_dataset("train", size=8),
    )
    groups = [object(), object()]
    trainer.use_vllm, trainer.vllm_generation = True, _EngineServingGroups(groups)
    trainer._last_loaded_step = -1  # TRL sets it where it builds its own engine
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    with generation_call(rows) as call:
        trainer._generate([row["prompt"] for row in rows])
    assert served_groups(call.groups, "TRL's _generate") == groups

    seen = []

    def rollout_func(prompts, trainer):
        seen.append(current_generation_call().rows)
        record_served_groups(groups)
        return {
            "prompt_ids": [[1]] * len(prompts),
            "completion_ids": [[5, 6]] * len(prompts),
            "logprobs": [[-0.5, -0.25]] * len(prompts),
        }

    trainer.rollout_func = rollout_func
    with generation_call(rows) as call:
        trainer._generate([row["prompt"] for row in rows])
    assert seen == [rows] and call.groups == groups
    assert current_generation_call() is None
    with pytest.raises(RuntimeError, match="no server engine groups were recorded"):
        served_groups([], "a driver that ran the engine elsewhere")


def _upstream_source(relative_path: str) -> str:
    import importlib.util
    from pathlib import Path

    top = relative_path.split("/")[0]
    site = Path(importlib.util.find_spec(top).origin).parent.parent
    return (site / relative_path).read_text()


def test_every_private_trl_attribute_the_package_touches_is_still_assigned_upstream():
    """compat/trl_trainer_state.py is the one place trlx_scale reads or writes TRL's (and transformers') private
    trainer state: each name it covers must still be assigned, as ``self.<name> =``, in the upstream file it names."""
    from trlx_scale.compat import trl_trainer_state as state

    assert state.supported(), f"TRL {trl.__version__} is not one compat/trl_trainer_state.py was checked against"
    for name, path in {**state.TRAINER_ATTRIBUTES, **state.GENERATION_ATTRIBUTES}.items():
        source = _upstream_source(path)
        assigned = re.search(rf"\bself\.{name}\s*(?::[^=\n]*)?=(?!=)", source) or re.search(
            rf"self\.{name}\s*,[^\n]*=|,\s*self\.{name}\s*=", source
        )
        assert assigned, f"{path} no longer assigns self.{name}: update compat/trl_trainer_state.py"


def test_no_module_outside_compat_names_a_private_trl_attribute():
    """The count the house keeps at 0: a private attribute assigned (``self._x =``) in TRL's trainer and generation
    modules or transformers' Trainer, and not a method there, named anywhere in trlx_scale but compat/."""
    import importlib.util
    from pathlib import Path

    upstream_files = [
        *Path(importlib.util.find_spec("trl.trainer").origin).parent.glob("*.py"),
        *Path(importlib.util.find_spec("trl.generation").origin).parent.glob("*.py"),
        Path(importlib.util.find_spec("transformers.trainer").origin),
    ]
    attributes, methods = set(), set()
    for path in upstream_files:
        source = path.read_text()
        attributes |= set(re.findall(r"\bself\.(_[a-z][a-z0-9_]*)\s*(?::[^=\n]*)?=(?!=)", source))
        methods |= set(re.findall(r"^\s+def (_[a-z][a-z0-9_]*)\(", source, re.M))
    private = attributes - methods
    assert "_metrics" in private  # the scan reads TRL's assignments at all
    package = Path(trlx_scale.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if "compat" in path.relative_to(package).parts:
            continue
        for name in sorted(set(re.findall(r"\.(_[a-z][a-z0-9_]*)\b", path.read_text())) & private):
            offenders.append(f"{path.relative_to(package)}: {name}")
    assert offenders == []


def test_trls_loss_still_runs_its_log_prob_pass_without_the_micro_batch():
    """compat/trl_loss_pass.py binds the loss pass's micro-batch because TRL's _compute_loss hands its log-prob pass
    token ids and masks only: when TRL passes the batch (or stops calling the pass there), the binding can go."""
    from trlx_scale.compat import trl_loss_pass

    assert trl.__version__.startswith(trl_loss_pass.TESTED_TRL)
    source = inspect.getsource(trl.GRPOTrainer._compute_loss)
    call = source[source.index("self._get_per_token_logps_and_entropies(") :]
    call = call[: call.index("\n        )") + 1]
    # The pass gets a few fields of the batch (image inputs), never the batch itself.
    arguments = re.sub(r"inputs\.get\(\"\w+\"\)", "", call).replace("input_ids", "")
    assert "inputs" not in arguments, call
    assert trl_loss_pass.loss_pass_batch() is None
    with trl_loss_pass.loss_pass_of({"batch": 1}):
        assert trl_loss_pass.loss_pass_batch() == {"batch": 1}
    assert trl_loss_pass.loss_pass_batch() is None


def test_trl_init_still_acts_on_the_fields_its_config_copy_switches():
    """compat/trl_init_config.py hands TRL's __init__ a copy with these fields switched: each must still be read where
    the switch matters (else the switch can go), the copy leaves the caller's object as it was, and no other field
    can be switched by mistake."""
    from transformers import Trainer

    from trlx_scale.compat.trl_init_config import SWITCHABLE, TESTED_TRL, config_for_trl_init

    assert trl.__version__.startswith(TESTED_TRL)
    assert "self.use_vllm = args.use_vllm" in inspect.getsource(trl.GRPOTrainer.__init__)
    assert "self.padding_free = args.padding_free" in inspect.getsource(trl.DPOTrainer.__init__)
    assert "self.args.remove_unused_columns" in inspect.getsource(Trainer._remove_unused_columns)
    assert "if len(args.reward_weights) != len(reward_funcs):" in inspect.getsource(trl.GRPOTrainer.__init__)
    assert set(SWITCHABLE) == {"use_vllm", "padding_free", "remove_unused_columns", "reward_weights"}
    args = GRPOConfig(output_dir="unused", report_to="none", bf16=False, use_vllm=True)
    trl_args = config_for_trl_init(args, use_vllm=False)
    assert args.use_vllm is True and trl_args.use_vllm is False and trl_args.learning_rate == args.learning_rate
    with pytest.raises(ValueError, match="switches only"):
        config_for_trl_init(args, learning_rate=1.0)
