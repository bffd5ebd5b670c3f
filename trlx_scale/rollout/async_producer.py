"""The asynchronous rollout producer: groups sampled and scored while the trainer trains, within a staleness bound.

The producer runs its own event loop on a background thread. The trainer talks to it through three calls:
``publish_version(v)`` after the weights of version ``v`` reached the server, ``take(count)`` for the next groups in
order (blocking, with a timeout), and ``pop_metrics()``. In numbered steps:

1. Groups are numbered in consumption order; ``prompt_for(k)`` gives group ``k``'s prompt (the trainer's data order,
   so a resumed run asks for the same prompts).
2. Group ``k`` starts when its scheduled version is on the server (``StalenessSchedule.may_start``), fewer than
   ``max_inflight_tasks`` groups are in flight, and fewer than ``queue_maxsize`` groups wait to be taken. Its request
   names the version (``StalenessSchedule.sampled_at``) and a seed that is a function of the run's seed, that
   version and ``k``: the group's samples do not depend on timing. A checkpoint saves the groups sampled by
   versions older than its weights (``admitted_groups``, ``rollout_window``); a resumed run queues them first
   (``ready``) and samples from the next group on.
3. The sampler (a vLLM server client, or the simulated engine of the benchmark) returns the completions with the
   behaviour log-probs and the version that really sampled them; a version outside the bound is an error
   (``StalenessSchedule.check``), never a silently off-policy sample.
4. The group is scored right away (``score``: reward functions awaited together, synchronous ones in a thread pool,
   ``reward_scoring``), concurrently with every other group in flight.
5. With dynamic sampling (a ``GroupReplacement``), a scored group without signal is dropped and its slot sampled
   again with another prompt, by the same version, within a bounded number of attempts (``rollout.group_replacement``);
   ``peek`` shows the trainer the groups ``take`` will hand out, so that it trains on their prompts.
6. ``take`` hands groups out in index order, so the trainer sees the same data, in the same order, as a synchronous
   run would; any error of a sampler or a reward function is raised there, in the trainer's thread.

Metrics (``pop_metrics``, over the window since the last call): ``async/staleness_mean`` and ``async/staleness_max``
of the groups taken, ``async/trainer_idle_frac`` (time blocked in ``take``), ``async/generator_idle_frac`` (time with
no group in flight: the engine had nothing to do), ``async/groups_in_flight`` and ``async/groups_ready``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .group_replacement import GroupReplacement, attempt_seed
from .request_gate import RequestGate
from .staleness import StalenessSchedule


@dataclass(frozen=True)
class GroupRequest:
    """One group to sample: ``num_generations`` completions of one prompt, by policy version ``version``."""

    index: int
    prompt: Any
    num_generations: int
    version: int
    seed: int


@dataclass
class SampledGroup:
    """What a sampler returns: the completions (token ids and, for rewards, text), the behaviour policy's log-prob of
    each sampled token, and the version that sampled them (the server's answer, not the request's). Where a weight
    update can land inside a completion (full weights reloaded with requests kept in flight), ``token_versions``
    holds each token's version and ``version`` is the oldest of them."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    version: int
    completions: list[Any] | None = None
    prompt_ids: list[int] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    token_versions: list[list[int]] | None = None


@dataclass
class ScoredGroup:
    """A sampled group with its rewards ((completions, reward functions), NaN for None) and its staleness. With
    dynamic sampling (``GroupReplacement``): how many groups its slot sampled (this one the last), whether it was
    kept for its signal (False: the slot ran out of attempts) and the prompt and completion tokens of the groups its
    slot dropped (generated, never trained: TRL's ``num_tokens`` counts the trained ones)."""

    request: GroupRequest
    sampled: SampledGroup
    rewards: list[list[float]]
    staleness: int
    attempts: int = 1
    informative: bool = True
    dropped_tokens: int = 0

    @property
    def index(self) -> int:
        return self.request.index


class GroupSampler(Protocol):
    """Samples one group; awaited on the producer's event loop."""

    async def sample(self, request: GroupRequest) -> SampledGroup: ...


GroupScore = Callable[[GroupRequest, SampledGroup], Awaitable[list[list[float]]]]


class RolloutProducerError(RuntimeError):
    """The producer stopped: a sampler, a reward function or the producer's own scheduling failed (the cause is
    chained, and its traceback, from the producer's thread, is in the message)."""


def _described(error: BaseException) -> str:
    """An error with the traceback of the thread that raised it: the trainer's thread re-raises it, and a traceback
    that ends in ``take`` would hide where the producer really failed."""
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    return f"{type(error).__name__}: {error}\nIn the producer's thread:\n{trace}"


def group_seed(seed: int, version: int, index: int) -> int:
    """A 63-bit sampling seed for group ``index`` sampled by ``version`` in a run seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}|async|{version}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class RolloutProducer:
    """Samples and scores groups ahead of the trainer within the staleness bound (see the module docstring)."""

    def __init__(
        self,
        *,
        prompt_for: Callable[[int], Any],
        sampler: GroupSampler,
        score: GroupScore,
        schedule: StalenessSchedule,
        num_generations: int,
        seed: int,
        max_inflight_tasks: int,
        queue_maxsize: int,
        seed_for: Callable[[int, int, Any], int] | None = None,
        ready: Sequence[ScoredGroup] = (),
        clock: Callable[[], float] = time.monotonic,
        gate: RequestGate | None = None,
        replacement: GroupReplacement | None = None,
    ):
        if max_inflight_tasks < 1:
            raise ValueError(f"max_inflight_tasks must be at least 1, got {max_inflight_tasks}.")
        if queue_maxsize < schedule.groups_per_version:
            raise ValueError(
                f"queue_maxsize ({queue_maxsize}) must hold at least one step's groups "
                f"({schedule.groups_per_version}), or the trainer could never take a full step."
            )
        self.prompt_for = prompt_for
        self.sampler = sampler
        self.score = score
        self.schedule = schedule
        self.num_generations = num_generations
        self.seed = seed
        self.max_inflight_tasks = max_inflight_tasks
        self.queue_maxsize = queue_maxsize
        # (group index, version, prompt) -> the request's seed; default: ``group_seed`` of the run's seed.
        self.seed_for = seed_for or (lambda index, version, prompt: group_seed(seed, version, index))
        self._clock = clock
        self.replacement = replacement  # dynamic sampling: a dropped group's slot is sampled again

        expected = list(range(schedule.start_index, schedule.start_index + len(ready)))
        if [group.index for group in ready] != expected:
            raise ValueError(
                f"the groups queued at the start must be groups {expected[:1]}..{expected[-1:]} in order, got "
                f"{[group.index for group in ready][:8]}."
            )
        self._lock = threading.Condition()
        self._published: int | None = None
        # A resumed run's checkpoint window (``rollout_window``) is queued first: sampling resumes after it.
        self._next_start = schedule.start_index + len(ready)
        self._next_take = schedule.start_index
        self._drain_until = schedule.start_index  # groups below it start even when the queue is full
        self._in_flight = 0
        # The gate a full-weight reload holds (``hold_requests``). Given: the sampler's own (a ``VLLMServerClient``
        # passes each HTTP request through it, so a trajectory waiting on its tool holds no reload). None: the
        # producer counts each group's ``sample`` as one request.
        self.gate = gate or RequestGate()
        self._sampler_gates_requests = gate is not None
        self._ready: dict[int, ScoredGroup] = {group.index: group for group in ready}
        self._error: BaseException | None = None
        self._closed = False
        self._stopped = False  # the loop thread has ended (an error, or close())

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()

        now = clock()
        self._window_start = now
        self._idle_since: float | None = now  # the generator is idle until the first group starts
        self._generator_idle = 0.0
        self._trainer_idle = 0.0
        self._taken_staleness: list[int] = []

    # ---------------------------------------------------------------- the trainer's side (any thread)
    def start(self) -> None:
        """Start the event loop thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the rollout producer was already started.")
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._wake = asyncio.Event()
            ready.set()
            try:
                self._loop.run_until_complete(self._schedule_groups())
            except BaseException as error:  # noqa: BLE001 - whatever kills the thread is the trainer's error
                self._fail(error)
            finally:
                self._loop.close()
                with self._lock:
                    self._stopped = True
                    self._lock.notify_all()

        self._thread = threading.Thread(target=run, name="trlx-scale-rollout-producer", daemon=True)
        self._thread.start()
        ready.wait()

    def publish_version(self, version: int) -> None:
        """The weights of ``version`` are on the server: the groups it samples may start."""
        with self._lock:
            if self._published is not None and version < self._published:
                raise ValueError(f"published version went back from {self._published} to {version}.")
            self._published = version
        self._poke()

    def take(self, count: int, timeout: float) -> list[ScoredGroup]:
        """The next ``count`` groups in order, blocking at most ``timeout`` seconds for them."""
        with self._lock:
            wanted = self._wait_for_next(count, timeout)
            groups = [self._ready.pop(index) for index in wanted]
            self._next_take += count
            self._taken_staleness.extend(group.staleness for group in groups)
        self._poke()  # room in the queue
        return groups

    def peek(self, count: int, timeout: float) -> list[ScoredGroup]:
        """The next ``count`` groups in order, as ``take`` would return them, left queued for ``take`` (dynamic
        sampling: the trainer trains on the prompts its slots' kept groups have)."""
        with self._lock:
            return [self._ready[index] for index in self._wait_for_next(count, timeout)]

    def _wait_for_next(self, count: int, timeout: float) -> range:
        """With the lock held: block (at most ``timeout`` seconds, counted as the trainer's idle time) until the next
        ``count`` groups are ready; their indices."""
        began = self._clock()
        deadline = time.monotonic() + timeout
        wanted = range(self._next_take, self._next_take + count)
        self._wait_until_ready(
            wanted,
            deadline,
            lambda missing: (
                f"no rollout for groups {missing[:8]} after {timeout:.0f} s (published version "
                f"{self._published}, {self._in_flight} groups in flight): the generation server answers too slowly "
                "or not at all. Check the server, or raise request_timeout."
            ),
        )
        self._trainer_idle += self._clock() - began
        return wanted

    def pop_metrics(self) -> dict[str, float]:
        """The ``async/*`` metrics of the window since the last call."""
        with self._lock:
            now = self._clock()
            elapsed = max(now - self._window_start, 1e-9)
            idle = self._generator_idle + (now - self._idle_since if self._idle_since is not None else 0.0)
            staleness = self._taken_staleness
            metrics = {
                "async/trainer_idle_frac": min(1.0, self._trainer_idle / elapsed),
                "async/generator_idle_frac": min(1.0, idle / elapsed),
                "async/groups_in_flight": float(self._in_flight),
                "async/groups_ready": float(len(self._ready)),
            }
            if staleness:
                metrics["async/staleness_mean"] = sum(staleness) / len(staleness)
                metrics["async/staleness_max"] = float(max(staleness))
            self._window_start = now
            self._generator_idle = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            self._trainer_idle = 0.0
            self._taken_staleness = []
        return metrics

    def fail(self, error: BaseException) -> None:
        """Fail the producer from outside (a weight update that did not reach the servers): ``take`` and the other
        waits raise ``error`` at once, and no group starts."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._lock.notify_all()
        self._poke()

    @contextlib.contextmanager
    def hold_requests(self, timeout: float):
        """No new request to the servers inside the block, which starts once those at a server have returned (a
        full-weight reload; the trainer's probe run alone on vLLM's CPU build). No group starts meanwhile either."""
        with self.gate.hold(timeout, give_up=lambda: self._error is not None):
            yield
        self._poke()

    def admitted_groups(self, timeout: float, partial: bool = False) -> list[ScoredGroup]:
        """Every group not taken yet that the published version admits, in order, once each is sampled and scored;
        they stay queued for ``take``. A checkpoint saves them (``rollout_window``): a resumed run no longer has the
        weights that sampled them. ``queue_maxsize`` does not hold them back (they are at most ``max_staleness + 1``
        steps' worth); ``max_inflight_tasks`` does. ``partial`` (a preemption's save, bounded by its grace period):
        after ``timeout`` return the ready ones before the first missing one instead of raising."""
        deadline = time.monotonic() + timeout
        with self._lock:
            end = self._admitted_end()
            self._drain_until = end
        self._poke()
        with self._lock:
            wanted = range(self._next_take, end)
            try:
                self._wait_until_ready(
                    wanted,
                    deadline,
                    lambda missing: (
                        f"groups {missing[:8]} were not sampled after {timeout:.0f} s (published version "
                        f"{self._published}): the generation server answers too slowly or not at all."
                    ),
                )
            except TimeoutError:
                if not partial:
                    raise
                ready = []
                for index in wanted:
                    if index not in self._ready:
                        break
                    ready.append(self._ready[index])
                return ready
            return [self._ready[index] for index in wanted]

    def sample_now(self, requests: Sequence[GroupRequest], timeout: float) -> list[SampledGroup]:
        """Sample ``requests`` on the producer's event loop, beside the schedule (evaluation): not scored, queued,
        or counted in the metrics; the schedule's groups keep going meanwhile. The sampler's client belongs to that
        loop, hence not a loop of the caller's."""
        with self._lock:
            if self._error is not None:
                raise RolloutProducerError(f"the rollout producer failed: {_described(self._error)}") from self._error
            if self._closed or self._stopped or self._loop is None:
                raise RolloutProducerError("the rollout producer is not running.")

        async def sample_all() -> list[SampledGroup]:
            return list(await asyncio.gather(*(self.sampler.sample(request) for request in requests)))

        future = asyncio.run_coroutine_threadsafe(sample_all(), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"{len(requests)} groups sampled outside the schedule took over {timeout:.0f} s."
            ) from None

    def admitted_count(self) -> int:
        """How many groups the published version admits that are not taken yet (``admitted_groups``' length)."""
        with self._lock:
            return self._admitted_end() - self._next_take

    def _admitted_end(self) -> int:
        """With the lock held: one past the last group the published version admits."""
        end = self._next_take
        while self.schedule.may_start(end, self._published):
            end += 1
        return end

    def _wait_until_ready(self, wanted: range, deadline: float, timed_out: Callable[[list[int]], str]) -> None:
        """With the lock held: block until every group of ``wanted`` is ready. The producer's error, its closing,
        or the deadline (``timed_out`` words the message from the missing groups) raise instead."""
        while not all(index in self._ready for index in wanted):
            if self._error is not None:
                raise RolloutProducerError(f"the rollout producer failed: {_described(self._error)}") from self._error
            if self._closed:
                raise RolloutProducerError("the rollout producer was closed.")
            if self._stopped:
                raise RolloutProducerError("the rollout producer's thread ended without an error or close().")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(timed_out([index for index in wanted if index not in self._ready]))
            self._lock.wait(min(remaining, 1.0))

    @property
    def next_index(self) -> int:
        """The first group not taken yet."""
        return self._next_take

    def close(self) -> None:
        """Cancel what is in flight and stop the loop thread."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._cancel_all)
            except RuntimeError:  # the loop closed in between (it stopped on an error): nothing left to cancel
                pass
            self._thread.join(timeout=30)

    # ---------------------------------------------------------------- the event loop's side
    def _poke(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop stopped in between: nothing left to wake
                pass

    def _cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._wake.set()

    def _startable(self) -> bool:
        index = self._next_start
        waiting = len(self._ready) + self._in_flight
        return (
            self._error is None
            and not self._closed
            and not self.gate.held
            and self._in_flight < self.max_inflight_tasks
            and (waiting < self.queue_maxsize or index < self._drain_until)
            and self.schedule.may_start(index, self._published)
        )

    def _fail(self, error: BaseException) -> None:
        """Record the producer's first error and wake every waiter: ``take`` and the other waits raise it at once
        (never a timeout that reads like a slow server)."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._lock.notify_all()
        if self._wake is not None and self._loop is not None and not self._loop.is_closed():
            self._wake.set()

    async def _schedule_groups(self) -> None:
        try:
            await self._start_groups_until_closed()
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _start_groups_until_closed(self) -> None:
        """The scheduling loop. Everything in it (the trainer's ``prompt_for`` and ``seed_for`` included) may raise:
        ``start``'s thread records that as the producer's error."""
        while True:
            with self._lock:
                if self._closed or self._error is not None:
                    break
                requests = []
                while self._startable():
                    requests.append(self._request(self._next_start))
                    self._next_start += 1
                    self._group_started()
            for request in requests:
                task = asyncio.get_running_loop().create_task(self._run_group(request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await self._wake.wait()
            self._wake.clear()

    def _request(self, index: int) -> GroupRequest:
        version = self.schedule.sampled_at(index)
        prompt = self.prompt_for(index)
        return GroupRequest(
            index=index,
            prompt=prompt,
            num_generations=self.num_generations,
            version=version,
            seed=self.seed_for(index, version, prompt),
        )

    def _group_started(self) -> None:
        if self._in_flight == 0 and self._idle_since is not None:
            self._generator_idle += self._clock() - self._idle_since
            self._idle_since = None
        self._in_flight += 1

    def _group_ended(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle_since = self._clock()

    async def _sample_and_score(self, request: GroupRequest) -> tuple[SampledGroup, list[list[float]]]:
        if self._sampler_gates_requests:
            sampled = await self.sampler.sample(request)
        else:
            async with self.gate.request():
                sampled = await self.sampler.sample(request)
        self.schedule.check(request.index, sampled.version)
        if len(sampled.completion_ids) != request.num_generations:
            raise RuntimeError(
                f"group {request.index}: the sampler returned {len(sampled.completion_ids)} completions, "
                f"{request.num_generations} were asked for."
            )
        return sampled, await self.score(request, sampled)

    async def _slot_group(self, request: GroupRequest) -> ScoredGroup:
        """The group the slot ``request.index`` trains on: its first group, or with dynamic sampling the first one
        kept among at most ``max_attempts`` (``rollout.group_replacement``)."""
        first, attempt, dropped_tokens = request, 0, 0
        while True:
            sampled, rewards = await self._sample_and_score(request)
            staleness = self.schedule.staleness(request.index, sampled.version)
            if self.replacement is None:
                return ScoredGroup(request, sampled, rewards, staleness)
            kept = self.replacement.keeps(rewards)
            attempt += 1
            if kept or attempt >= self.replacement.max_attempts:
                return ScoredGroup(
                    request,
                    sampled,
                    rewards,
                    staleness,
                    attempts=attempt,
                    informative=kept,
                    dropped_tokens=dropped_tokens,
                )
            dropped_tokens += self.replacement.token_count(sampled)
            prompt = self.replacement.prompt_for(first.prompt, attempt)
            seed = self.seed_for(first.index, first.version, prompt)
            request = dataclasses.replace(first, prompt=prompt, seed=attempt_seed(seed, attempt))

    async def _run_group(self, request: GroupRequest) -> None:
        try:
            scored = await self._slot_group(request)
        except asyncio.CancelledError:
            with self._lock:
                self._group_ended()
            raise
        except Exception as error:  # handed to the trainer's thread by take()
            with self._lock:
                self._group_ended()
            self._fail(error)
            return
        with self._lock:
            self._group_ended()
            self._ready[request.index] = scored
            self._lock.notify_all()
        self._wake.set()
