"""The rollout engine on vLLM servers: a ``RolloutEngine`` whose completions come from the asynchronous producer.

``AsyncGRPOTrainer`` hands this object to TRL where TRL expects its vLLM engine (``vllm_generation``), as
``GRPOTrainer`` hands it the colocated one. Two duties:

1. Weights (``ensure_version``): at every ``weight_sync_steps``-th policy version the trainer's weights go to every
   server through a ``ServerWeightTransport`` (``server_weight_transports``: the LoRA adapter as files under the
   version's own name, the full (merged) weights as files reloaded in place, or vLLM's NCCL transfer on GPUs). Every update is verified, not trusted (verl 7495: an adapter never delivered, and the
   rollouts sampled the initial policy for the whole run): the servers' log-probs of a probe sequence must match
   the trainer's own by the new weights within ``verify_tolerance``, else the run stops with an error. Then the
   version is published to the producer, and the adapters no group can still ask for are unloaded. A full-weight
   reload either holds every rank's requests from before it until every rank knows the new version, so no sample
   carries the tag of weights that did not sample it (``full_weight_reload="drain"``), or keeps them in flight at
   the servers, which tag every token with the version that sampled it (``"keep"``).
2. Completions (``generate``): TRL's call for a rollout takes the producer's next groups, checks that their prompts
   are the ones TRL tokenized, and returns them in TRL's shape; the groups reach the trainer's sampling stage through the generation call
   (``compat.trl_generation_call``), for the rewards, policy versions and tool trajectories the producer computed. An evaluation rollout's prompts are sampled at once instead, by the version
   served, seeded as the colocated engine seeds them.

Gathering weights is a collective under ZeRO-3, so every rank runs ``ensure_version``; the main process alone
writes and talks to the servers (the transport's business), then every rank publishes the version to its own
producer.

Faults reach every rank (``reliability.rank_agreement.failing_together``): a failure of the main process's send or
verification, of any rank's hold before a reload, or of any rank's ``take`` (its producer: a server that died, a
reward function that raised, a crash) is raised as the same ``RankFailureError`` on every rank right after the
block, never left to a collective's timeout on the ranks that did not fail.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..compat.trl_generation_call import record_served_groups
from ..compat.vllm_cpu_lora_scoring import lora_breaks_prompt_logprobs
from ..profiling.phase_timer import PhaseTimer
from ..reliability.rank_agreement import failing_together
from ..rollout.async_producer import GroupRequest, RolloutProducer, RolloutProducerError, ScoredGroup
from ..rollout.staleness import StalenessSchedule
from .background_delivery import BackgroundDelivery
from .cpu_environment import running_on_cpu_only
from .delivery_rendezvous import DeliveryRendezvous
from .rollout_seeds import RolloutSeedContext, request_seed
from .server_client import ServerError, VLLMServerClient
from .server_weight_transports import FullWeightFilesTransport, ServerWeightTransport, build_server_transport
from .vllm_server import VLLMServerProcess

logger = logging.getLogger(__name__)


class WeightDeliveryError(RuntimeError):
    """A server does not serve the weights it was sent."""


class ServerGeneration:
    """See the module docstring."""

    in_training_processes = False  # the planner's question: the servers' memory is on devices of their own

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        accelerator: Any,
        client: VLLMServerClient,
        producer: RolloutProducer,
        schedule: StalenessSchedule,
        policy_version: Callable[[], int],
        probe_ids: list[int],
        verify_tolerance: float,
        request_timeout: float,
        weights_root: str | None = None,
        server_process: VLLMServerProcess | None = None,
        before_publish: Callable[[int], None] | None = None,
        weights_dtype: torch.dtype | None = None,
        transport: ServerWeightTransport | None = None,
        background_delivery: bool = False,
    ):
        self.model = model
        self.accelerator = accelerator
        self.client = client
        self.producer = producer
        self.schedule = schedule
        self._policy_version = policy_version
        self.probe_ids = probe_ids
        self.verify_tolerance = verify_tolerance
        self.request_timeout = request_timeout
        self.server_process = server_process
        self.before_publish = before_publish  # the trainer's prompt prefetch for the groups a version admits
        self.weights_dtype = weights_dtype  # the servers' dtype: full weights are written in it
        # How versions travel (server_weight_transports): files by default, an adapter per version for LoRA.
        self.transport = transport or build_server_transport(
            "files", accelerator=accelerator, client=client, weights_dtype=weights_dtype, weights_root=weights_root
        )
        self.sync_mode = "lora" if client.lora else "full"
        self.background_delivery = background_delivery
        self._pending: BackgroundDelivery | None = None  # an update whose server side is still running
        # Several processes: where their delivery threads agree on each update (every rank builds this object at
        # the same point: the store's port is broadcast). Each stage (a hold, the reload, the probe) is an HTTP
        # wait bounded by request_timeout.
        self._rendezvous = (
            DeliveryRendezvous.create(accelerator, timeout=request_timeout + 60) if background_delivery else None
        )
        self._served_version: int | None = None
        self.phase_timer = PhaseTimer(enabled=False)
        self.excluded_parameter_prefixes: tuple[str, ...] = ()
        self._last_probe: torch.Tensor | None = None  # the trainer's probe log-probs of the last delivered version
        self._step_metrics: dict[str, float] = {}
        self._seed_context: RolloutSeedContext | None = None
        self._delivered: list[int] = []  # versions sent and not released (their files, on the main process)
        self._closed = False

    # ---------------------------------------------------------------- weights
    @property
    def served_version(self) -> int | None:
        """The version the servers serve (None before the first update). An update still landing counts once it
        has landed (``finish_delivery``)."""
        return self._served_version

    @served_version.setter
    def served_version(self, version: int | None) -> None:
        self.finish_delivery()  # weights replaced from outside (a checkpoint): an update in flight lands first
        self._served_version = version

    def ensure_version(self, version: int, wait: bool = False) -> bool:
        """Send ``version``'s weights to the servers if it is a sync version not sent yet; True if sent. With
        ``background_delivery`` the servers' side of a full-weight update runs in a thread and this returns before
        it has landed, unless ``wait`` (evaluation samples from the served version at once)."""
        if self._pending is not None and version <= self._pending.version and not wait:
            return False  # on its way (TRL asks again within the same rollout)
        if self._pending is not None:
            with self.phase_timer.phase("weight_sync"):  # what the last update still takes is the trainer's wait
                self.finish_delivery()
        if self.served_version is not None and version <= self.served_version:
            return False
        if self.served_version is not None and version % self.schedule.weight_sync_steps:
            return False  # between syncs: the servers keep the last synced version (the first is always sent)
        if self.background_delivery and self.served_version is not None:  # the first update: the run waits for it
            with self.phase_timer.phase("weight_sync"):
                self._start_background_delivery(version)
                if wait:
                    self.finish_delivery()
            return True
        with self.phase_timer.phase("weight_sync"):
            began = time.perf_counter()
            with self._hold_for_reload():
                with failing_together(self.accelerator, f"sending policy version {version}'s weights to the servers"):
                    paused = self._send(version)
                with self._probe_alone():
                    with failing_together(self.accelerator, f"verifying policy version {version} on the servers"):
                        self._verify(version)
                self.accelerator.wait_for_everyone()
                if not self.accelerator.is_main_process:  # the main process updated the servers for every rank
                    self.client.record_update(version)
            self._served_version = version
            if self.before_publish is not None:
                self.before_publish(version)
            self.producer.publish_version(version)
            self._release_unused_versions()
        self._record_update(time.perf_counter() - began, paused, background=False)
        return True

    def _record_update(self, seconds: float, paused: float, background: bool) -> None:
        self._step_metrics["sync/seconds"] = seconds
        self._step_metrics["sync/paused_seconds"] = paused
        self._step_metrics["sync/lora_only"] = float(self.sync_mode == "lora")
        self._step_metrics["sync/background"] = float(background)

    def _start_background_delivery(self, version: int) -> None:
        """The trainer's part of ``version``'s update now (the files, its probe log-probs, the prompts the version
        admits: model, collectives and tokenizer stay on this thread), the servers' part in a thread
        (``background_delivery``), which publishes the version to the producer once it is served and verified."""
        began = time.perf_counter()
        with failing_together(self.accelerator, f"writing policy version {version}'s weights for the servers"):
            self._send_files(version)
        current = self._trainer_probe_logprobs()
        previous, self._last_probe = self._last_probe, current
        if self.before_publish is not None:
            self.before_publish(version)  # prefetched only: no group of the version starts before it is published
        drain = not self.client.keep_requests_on_reload  # full weights here: "drain" holds around the reload
        probe_alone = lora_breaks_prompt_logprobs(running_on_cpu_only())

        def held(needed: bool):
            return self.producer.hold_requests(timeout=self.request_timeout) if needed else contextlib.nullcontext()

        def deliver() -> tuple[float, float | None, float]:
            if self._rendezvous is None:
                with held(drain):
                    paused = self.transport.load(version)
                    with held(probe_alone and not drain):  # "keep" on vLLM's CPU build: the probe alone, as inline
                        gap = self._check_served_probe(version, current, previous)
            else:
                paused, gap = deliver_agreed(held(drain or probe_alone))
            self.producer.publish_version(version)  # its groups start now, while the trainer trains
            return paused, gap, time.perf_counter() - began

        def deliver_agreed(hold) -> tuple[float, float | None]:
            """Several processes (``delivery_rendezvous``): every rank holds from before the reload until the main
            process has verified it (each rank's hold is its own thread's), then each learns the outcome."""
            rendezvous = self._rendezvous
            with contextlib.ExitStack() as holding:
                try:
                    holding.enter_context(hold)
                except BaseException as error:
                    rendezvous.report_held(version, error)
                    if self.accelerator.is_main_process:  # no reload then: the others wait for this outcome
                        rendezvous.announce(version, error)
                    raise
                rendezvous.report_held(version, None)
                if not self.accelerator.is_main_process:
                    rendezvous.wait_for_outcome(version)
                    self.client.record_update(version)  # the main process updated the servers for every rank
                    return 0.0, None
                try:
                    rendezvous.wait_until_every_rank_holds(version)
                    paused = self.transport.load(version)
                    gap = self._check_served_probe(version, current, previous)
                except BaseException as error:
                    rendezvous.announce(version, error)
                    raise
                rendezvous.announce(version, None)
                return paused, gap

        def failed(error: BaseException) -> None:
            self.producer.fail(error)  # a trainer waiting for groups hears of it now

        self._pending = BackgroundDelivery(version, deliver, failed)

    def finish_delivery(self, timeout: float | None = None, together: bool = True) -> None:
        """Wait for an update whose servers' side runs in the background; raise its error, if it failed (the same
        error on every rank). With a ``timeout`` (a preemption's grace period), an update still running then on
        any rank is left to land on its own. Every rank calls it at the same point, unless not ``together`` (the
        run's close, which may come from one rank's failure: no collective there)."""
        if self._pending is None:
            return
        landed = self._pending.wait(timeout)
        if together and timeout is not None and self._rendezvous is not None:
            landed = self._on_every_rank(landed)  # the ranks' checkpoint windows must agree
            if landed:
                self._pending.wait(None)
        if not landed:
            return
        pending, self._pending = self._pending, None
        context = (
            failing_together(self.accelerator, f"delivering policy version {pending.version} to the servers")
            if together
            else contextlib.nullcontext()
        )
        with context:
            paused, gap, seconds = pending.finish()
        self._served_version = pending.version
        self._release_unused_versions()
        if gap is not None:  # the main process's check (as inline: the others log none)
            self._step_metrics["sync/probe_logprob_gap"] = gap
        self._record_update(seconds, paused, background=True)

    def _on_every_rank(self, flag: bool) -> bool:
        """``flag`` AND-ed over every rank (one MIN all-reduce; every rank calls it at the same point)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return bool(value.item() > 0)

    def sync_weights(self) -> None:
        """TRL's name for it: bring the servers to the trainer's current version."""
        self.ensure_version(self._policy_version())

    def _send(self, version: int) -> float:
        """Deliver ``version`` through the transport (every rank); returns the seconds the servers were paused."""
        delivery = self.transport.deliver(self.accelerator.unwrap_model(self.model), version)
        self._count_delivered(version, delivery)
        return delivery.paused_seconds

    def _send_files(self, version: int) -> None:
        """The trainer's part of a full-weight update: ``version``'s files (``FullWeightFilesTransport.write``)."""
        self._count_delivered(version, self.transport.write(self.accelerator.unwrap_model(self.model), version))

    def _count_delivered(self, version: int, delivery) -> None:
        self._delivered.append(version)
        if delivery.gathered_bytes is not None:
            self._step_metrics["sync/gathered_bytes"] = delivery.gathered_bytes

    @contextlib.contextmanager
    def _hold_for_reload(self):
        """Full weights: no rank's producer sends a request from before the reload until every rank knows the new
        version. A server reloads in place, so a request's version is the one its client knew when sending it; one
        sent while the server is paused for the reload would wait there, be sampled by the new weights, and carry
        the old version's tag. Adapters need no hold: each request names its version's adapter. Nor do requests the
        reload keeps in flight (``full_weight_reload="keep"``): the server tags each token with its version."""
        if self.sync_mode == "lora" or self.client.keep_requests_on_reload:
            yield
            return
        with self._held_on_every_rank("holding requests for a full-weight reload"):
            yield

    @contextlib.contextmanager
    def _probe_alone(self):
        """On vLLM 0.32's CPU build a prompt-scoring request batched with sampling requests crashes a LoRA-enabled
        engine (``compat.vllm_cpu_lora_scoring``; seen with the probe: an einsum size mismatch in the CPU LoRA
        logits path, then the engine is dead). There every rank's producer holds its requests until the probe has
        run alone; elsewhere the probe runs beside them."""
        if not lora_breaks_prompt_logprobs(running_on_cpu_only()):
            yield
            return
        with self._held_on_every_rank("holding requests for the weight probe"):
            yield
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def _held_on_every_rank(self, what: str):
        """Every rank's producer holds its requests (each waits for its own in flight to come back, within
        ``request_timeout``); a rank whose wait fails makes every rank fail, instead of leaving the others in the
        barrier."""
        with contextlib.ExitStack() as held:
            with failing_together(self.accelerator, what):
                held.enter_context(self.producer.hold_requests(timeout=self.request_timeout))
            yield

    def _trainer_probe_logprobs(self) -> torch.Tensor:
        """The trainer's log-probs of the probe (a forward on every rank: ZeRO-3 gathers inside it)."""
        ids = torch.tensor([self.probe_ids], device=self.accelerator.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        finally:
            self.model.train(was_training)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()

    def _verify(self, version: int) -> None:
        """The servers' log-probs of the probe against the trainer's by the new weights (``current``) and by the
        last delivered ones (``previous``). Delivered: within ``verify_tolerance`` of the current ones (numerics:
        kernels, a merged adapter), or closer to them than to the previous ones (updates larger than the numerics).
        Not delivered: a server still serving the previous (or the initial) weights is closer to those."""
        current = self._trainer_probe_logprobs()
        previous, self._last_probe = self._last_probe, current
        if self.accelerator.is_main_process:
            self._step_metrics["sync/probe_logprob_gap"] = self._check_served_probe(version, current, previous)

    def _check_served_probe(self, version: int, current: torch.Tensor, previous: torch.Tensor | None) -> float:
        """The servers' log-probs of the probe against the trainer's ``current`` ones (``_verify``; the main
        process, no model: a background delivery runs it in its thread); returns the last server's gap."""
        gap = 0.0
        for url, served in zip(
            self.client.base_urls, self.client.prompt_logprobs(self.probe_ids, version), strict=True
        ):
            served = torch.tensor(served)
            gap = (served - current).abs().max().item()
            if gap <= self.verify_tolerance:
                continue
            gap_to_previous = None if previous is None else (served - previous).abs().max().item()
            if gap_to_previous is not None and gap < gap_to_previous:
                continue
            raise WeightDeliveryError(
                f"the vLLM server at {url} does not serve policy version {version}: its log-probs of the probe "
                f"differ from the trainer's by up to {gap:.3g} (tolerance {self.verify_tolerance:.3g}, "
                "weight_sync_verify_tolerance)"
                + ("" if gap_to_previous is None else f", from the previous version's by {gap_to_previous:.3g}")
                + ". The weights sent did not arrive; stopping rather than sampling from other weights."
            )
        return gap

    def _release_unused_versions(self) -> None:
        """Unload adapters (and delete files) of versions no group still to be sampled can ask for (the main
        process; the others forget them)."""
        oldest_needed = min(self.schedule.sampled_at(self.producer.next_index), self.served_version)
        for version in sorted(self.client.loaded_adapters):
            if version >= oldest_needed:
                break
            if self.accelerator.is_main_process:
                self.client.unload_adapter(version)
            else:
                self.client.loaded_adapters.pop(version)
        for version in [v for v in self._delivered if v < oldest_needed]:
            self.transport.release(version)
            self._delivered.remove(version)

    # ---------------------------------------------------------------- completions
    def set_rollout_seed(self, seed: int, step: int, mode: str = "train") -> None:
        """Training seeds are the producer's (a function of the run's seed, the group and its version); this context
        seeds evaluation, which samples outside the schedule, as the colocated engine seeds it."""
        self._seed_context = RolloutSeedContext(seed, self.accelerator.process_index, step, mode)

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's vLLM ``generate``: ``prompts`` are token-id rows, each group's prompt ``num_generations`` times."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("asynchronous generation takes text prompts only (the batch has images).")
        if self._seed_context is not None and self._seed_context.mode == "eval":
            return self._generate_for_evaluation(prompts, num_generations)
        groups = self.take_groups(len(prompts) // num_generations, prompts[::num_generations])
        completion_ids = [ids for group in groups for ids in group.sampled.completion_ids]
        logprobs = [[[value] for value in values] for group in groups for values in group.sampled.logprobs]
        return list(prompts), completion_ids, logprobs, None

    @contextlib.contextmanager
    def _update_error_first(self):
        """A producer that stopped because a weight update failed raises that update's error (not finish_delivery,
        a collective: another rank's delivery may not have ended yet; the caller's block tells every rank)."""
        try:
            yield
        except RolloutProducerError:
            if self._pending is not None and self._pending.error is not None:
                pending, self._pending = self._pending, None
                raise pending.error from pending.error.__cause__  # its own cause kept
            raise

    def take_groups(self, count: int, prompt_ids: list[list[int]] | None = None) -> list[ScoredGroup]:
        """The producer's next ``count`` scored groups (the same error on every rank if any rank fails);
        ``prompt_ids``: the trainer's tokenization of each group's prompt, checked against the
        producer's (None: the rollout renders its own prompts, a ``GymRollout``)."""
        with failing_together(self.accelerator, "taking this step's rollout groups"):
            with self._update_error_first():
                groups = self.producer.take(count, timeout=self.request_timeout)
            for group, row in zip(groups, prompt_ids or [], strict=False):
                if list(row) != list(group.sampled.prompt_ids):
                    raise RuntimeError(
                        f"group {group.index}: the producer sampled another prompt than the one the trainer "
                        f"tokenized ({len(group.sampled.prompt_ids)} vs {len(row)} tokens). The chat template or "
                        "the tokenizer settings differ between the two."
                    )
        for name, value in self.producer.pop_metrics().items():
            self._step_metrics[name] = value
        record_served_groups(groups)  # for the trainer's sampling stage (compat.trl_generation_call)
        return groups

    def upcoming_groups(self, count: int) -> list[ScoredGroup]:
        """The groups the next ``take_groups(count)`` returns, once ready, left queued (dynamic sampling: the
        trainer's rows are the prompts of its slots' kept groups); the same error on every rank if any rank fails."""
        with failing_together(self.accelerator, "waiting for this step's rollout groups"):
            with self._update_error_first():
                return self.producer.peek(count, timeout=self.request_timeout)

    def _generate_for_evaluation(self, prompts, num_generations):
        """Evaluation's prompts are not the producer's stream: sampled now, by the version served (the trainer's
        current weights: the trainer sent them before evaluating), on the producer's loop beside its groups."""
        context = self._seed_context
        requests = [
            GroupRequest(
                index=position,
                prompt={"prompt_ids": list(prompts[start])},
                num_generations=num_generations,
                version=self.served_version,
                seed=request_seed(context, prompts[start], context.rank * len(prompts) + start),
            )
            for position, start in enumerate(range(0, len(prompts), num_generations))
        ]
        with failing_together(self.accelerator, "sampling the evaluation prompts on the servers"):
            groups = self.producer.sample_now(requests, timeout=self.request_timeout)
        completion_ids = [ids for group in groups for ids in group.completion_ids]
        logprobs = [[[value] for value in values] for group in groups for values in group.logprobs]
        return list(prompts), completion_ids, logprobs, None

    def sequence_logprobs(self, sequences: list[list[int]], use_adapter: bool = False) -> list[list[float]]:
        raise NotImplementedError("sequence scoring runs on the colocated engine (DPO), not on the server.")

    def pop_metrics(self) -> dict[str, float]:
        metrics, self._step_metrics = self._step_metrics, {}
        return metrics

    def close(self) -> None:
        """Stop the producer, delete the version files and stop the server this run started."""
        if self._closed:
            return
        self._closed = True
        try:
            # Its thread reads the version files deleted below. Bounded: a run that failed elsewhere (another rank
            # gone) may have left it waiting for an answer that will not come; the thread is a daemon.
            self.finish_delivery(timeout=self.request_timeout, together=False)
        except Exception as error:  # noqa: BLE001 - the run is over; whatever stopped it is the error to raise
            logger.warning("the last weight update did not reach the servers: %s", error)
        self.producer.close()
        if self.accelerator.is_main_process and self.server_process is None:
            # A server the user started outlives the run: give its adapter slots back.
            for version in list(self.client.loaded_adapters):
                try:
                    self.client.unload_adapter(version)
                except ServerError as error:
                    logger.warning("could not unload policy version %d's adapter: %s", version, error)
                    break
        self.transport.close()
        self._delivered.clear()
        if self._rendezvous is not None:
            self._rendezvous.close()
        if self.server_process is not None:
            self.server_process.stop()


def delivers_in_background(setting: str, transport: ServerWeightTransport, num_processes: int) -> bool:
    """``weight_delivery`` (``"auto"``, ``"background"``, ``"inline"``) for this run: whether a full-weight update's
    servers' side runs in a thread. It can with full weights through files (adapters are loaded under a name of
    their own: no reload to wait for); ``"background"`` where it cannot is refused. ``"auto"`` chooses it with one
    training process, where it was measured faster; with several, every update's agreement goes through the
    ``delivery_rendezvous`` store, which ``"background"`` asks for."""
    possible = isinstance(transport, FullWeightFilesTransport)
    if setting == "background" and not possible:
        raise ValueError(
            "weight_delivery='background' runs a full-weight update's servers' side in a thread: it needs full "
            "weights through files (vllm_server_weight_transfer='files', a policy that is not LoRA or "
            f"vllm_sync_mode='full'); this run has the {transport.name!r} transport. Set weight_delivery='auto' or "
            "'inline'."
        )
    if setting == "auto":
        return possible and num_processes == 1
    return possible and setting == "background"
