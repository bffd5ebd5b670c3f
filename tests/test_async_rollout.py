"""The asynchronous rollout producer without a server: the staleness schedule, concurrent reward scoring, and the
producer driven by the simulated engine (bounded staleness, order, determinism, errors, metrics)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trlx_scale.rollout.async_producer import (
    GroupRequest,
    RolloutProducer,
    RolloutProducerError,
    SampledGroup,
    ScoredGroup,
    group_seed,
)
from trlx_scale.rollout.reward_scoring import ConcurrentRewardScorer
from trlx_scale.rollout.staleness import StalenessSchedule

from .helpers.simulated_engine import SimulatedEngine, lognormal_duration


def test_schedule_by_hand():
    """g=2 groups per version, s=1, w=1: groups 0-1 train at v0, 2-3 at v1, 4-5 at v2. The oldest admissible
    version is t - 1, never below 0: groups 0-3 are sampled by v0, 4-5 by v1. So at v0 four groups may start (two
    steps' worth: one step ahead), at v1 six."""
    schedule = StalenessSchedule(groups_per_version=2, max_staleness=1)
    assert [schedule.trained_at(k) for k in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [schedule.sampled_at(k) for k in range(6)] == [0, 0, 0, 0, 1, 1]
    assert [k for k in range(10) if schedule.may_start(k, 0)] == [0, 1, 2, 3]
    assert [k for k in range(10) if schedule.may_start(k, 1)] == [0, 1, 2, 3, 4, 5]
    assert not schedule.may_start(0, None)


def test_schedule_sync_and_weight_sync_steps():
    """s=0 is synchronous: group k is sampled by the version that trains it. With w=2 (weights sent every 2 steps)
    and s=1, versions 0, 2, 4 exist on the server: t=1 -> oldest 0 -> v0; t=2 -> 1 -> rounded up to v2; t=3 -> 2."""
    sync = StalenessSchedule(groups_per_version=3, max_staleness=0)
    assert all(sync.sampled_at(k) == sync.trained_at(k) for k in range(30))
    every_two = StalenessSchedule(groups_per_version=1, max_staleness=1, weight_sync_steps=2)
    assert [every_two.sampled_at(k) for k in range(5)] == [0, 0, 2, 2, 4]
    with pytest.raises(ValueError, match="max_staleness .* must be at least weight_sync_steps - 1"):
        StalenessSchedule(groups_per_version=1, max_staleness=0, weight_sync_steps=2)
    with pytest.raises(RuntimeError, match="staleness 2 is outside"):
        StalenessSchedule(groups_per_version=1, max_staleness=1).check(2, 0)
    with pytest.raises(RuntimeError, match="staleness -1"):  # sampled by weights newer than the trainer's
        StalenessSchedule(groups_per_version=1, max_staleness=1).check(0, 1)


def test_schedule_resumes_where_it_stopped():
    """A schedule started at group 8 and version 4 (a resume) numbers as the uninterrupted one does."""
    straight = StalenessSchedule(groups_per_version=2, max_staleness=2)
    resumed = StalenessSchedule(groups_per_version=2, max_staleness=2, start_index=8, start_version=4)
    assert [resumed.sampled_at(k) for k in range(8, 20)] == [straight.sampled_at(k) for k in range(8, 20)]


def test_reward_scorer_awaits_async_and_pools_sync_functions():
    """Two reward functions (one a coroutine, one blocking) score four groups at once: each function's four calls
    are in flight together (each waits for the other three, which only calls that overlap can do)."""
    groups_at_once = 4
    sandboxes_in_flight = threading.Barrier(groups_at_once, timeout=30)
    verifiers_in_flight = {"count": 0}

    async def remote_verifier(prompts, completions, completion_ids, **kwargs):
        verifiers_in_flight["count"] += 1
        for _ in range(10_000):  # yields to the loop until all four are in flight (or fails)
            if verifiers_in_flight["count"] == groups_at_once:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("the coroutine reward calls did not overlap")
        return [float(len(text)) for text in completions]

    def sandbox(prompts, completions, completion_ids, **kwargs):
        sandboxes_in_flight.wait()  # BrokenBarrierError unless four calls run at once
        return [None if text == "skip" else 1.0 for text in completions]

    scorer = ConcurrentRewardScorer([remote_verifier, sandbox], max_workers=8)

    async def score_four():
        groups = [["ab", "skip"], ["a", "abc"], ["", "x"], ["xy", "z"]]
        return await asyncio.gather(*(scorer.score(["p"] * 2, g, [[1]] * 2) for g in groups))

    results = asyncio.run(score_four())
    scorer.close()
    assert results[0][0] == [2.0, 1.0] and results[0][1][0] == 4.0 and results[0][1][1] != results[0][1][1]  # NaN
    assert results[1] == [[1.0, 1.0], [3.0, 1.0]]


def test_reward_scorer_names_a_function_with_the_wrong_count():
    def short(prompts, completions, completion_ids, **kwargs):
        return [1.0]

    scorer = ConcurrentRewardScorer([short])
    with pytest.raises(ValueError, match="'short' returned 1 rewards, but 2 were expected"):
        asyncio.run(scorer.score(["p", "p"], ["a", "b"], [[1], [2]]))
    scorer.close()


def test_score_now_runs_from_a_synchronous_trainer_concurrently_or_in_turn():
    """score_now (the synchronous trainers'): concurrently, a coroutine and a blocking function overlap (the blocking
    one waits until the coroutine has started); with sequential=True (reward_scoring="sequential") they run one after
    the other in their listed order, the blocking one on the caller's thread and the coroutine on the scorer's loop;
    the rewards are the same."""
    threads, order = [], []
    verifier_started = threading.Event()
    mode = {"sequential": False}

    async def remote_verifier(prompts, completions, completion_ids, **kwargs):
        order.append("verifier")
        verifier_started.set()
        return [float(len(text)) for text in completions]

    def sandbox(prompts, completions, completion_ids, **kwargs):
        threads.append(threading.current_thread())
        order.append("sandbox starts")
        if not mode["sequential"]:
            assert verifier_started.wait(30), "the blocking reward did not overlap the coroutine"
        order.append("sandbox")
        return [1.0 for _ in completions]

    results = {}
    for sequential in (False, True):
        mode["sequential"] = sequential
        verifier_started.clear()
        order.clear()
        scorer = ConcurrentRewardScorer([remote_verifier, sandbox], max_workers=2, sequential=sequential)
        results[sequential] = scorer.score_now(["p"] * 2, ["ab", "c"], [[1], [2]], trainer_state=None)
        scorer.close()
        if sequential:
            assert order == ["verifier", "sandbox starts", "sandbox"]
    assert results[False] == results[True] == [[2.0, 1.0], [1.0, 1.0]]
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()


async def _length_reward(request: GroupRequest, sampled: SampledGroup) -> list[list[float]]:
    return [[float(sum(ids) % 7)] for ids in sampled.completion_ids]


def _run_simulated_training(
    *, steps: int, groups_per_step: int, max_staleness: int, train_time: float, engine: SimulatedEngine, seed: int = 0
):
    """A trainer loop against the producer: publish v, take a step's groups, 'train', publish v+1."""
    schedule = StalenessSchedule(groups_per_version=groups_per_step, max_staleness=max_staleness)
    producer = RolloutProducer(
        prompt_for=lambda k: f"prompt-{k}",
        sampler=engine,
        score=_length_reward,
        schedule=schedule,
        num_generations=4,
        seed=seed,
        max_inflight_tasks=64,
        queue_maxsize=1024,
    )
    producer.start()
    taken, metrics = [], []
    try:
        engine.publish(0)
        producer.publish_version(0)
        for step in range(steps):
            groups = producer.take(groups_per_step, timeout=30)
            taken.extend(groups)
            time.sleep(train_time)
            engine.publish(step + 1)
            producer.publish_version(step + 1)
            metrics.append(producer.pop_metrics())
    finally:
        producer.close()
    return taken, metrics


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_producer_keeps_the_bound_and_the_order(max_staleness):
    engine = SimulatedEngine(slots=8, mean_group_time=0.01, sigma=1.0)
    taken, metrics = _run_simulated_training(
        steps=6, groups_per_step=3, max_staleness=max_staleness, train_time=0.02, engine=engine
    )
    assert [group.index for group in taken] == list(range(18))
    assert all(group.request.prompt == f"prompt-{group.index}" for group in taken)
    assert max(group.staleness for group in taken) <= max_staleness
    assert all(group.sampled.version == group.request.version for group in taken)
    assert max(m["async/staleness_max"] for m in metrics) <= max_staleness
    if max_staleness > 0:  # from the step after the first, the groups came from older weights: the run overlapped
        assert max(group.staleness for group in taken) == max_staleness
    else:
        assert all(group.staleness == 0 for group in taken)


def test_producer_output_does_not_depend_on_timing():
    """The same run with a fast and a slow engine takes the same groups: same versions, seeds, completions, rewards."""
    fast, _ = _run_simulated_training(
        steps=4, groups_per_step=2, max_staleness=2, train_time=0.0, engine=SimulatedEngine(8, 0.002)
    )
    slow, _ = _run_simulated_training(
        steps=4, groups_per_step=2, max_staleness=2, train_time=0.03, engine=SimulatedEngine(2, 0.02)
    )
    assert [(g.request, g.sampled.completion_ids, g.rewards) for g in fast] == [
        (g.request, g.sampled.completion_ids, g.rewards) for g in slow
    ]
    assert fast[5].request.seed == group_seed(0, fast[5].request.version, 5)


def test_overlap_beats_alternation_on_long_tail_completions():
    """Log-normal group times (sigma 1): a synchronous step waits for its slowest group, then trains; with
    max_staleness=2 generation runs during training. The overlapped run is clearly faster (measured ~2x here)."""

    def run(max_staleness: int) -> float:
        began = time.monotonic()
        _run_simulated_training(
            steps=8,
            groups_per_step=4,
            max_staleness=max_staleness,
            train_time=0.04,
            engine=SimulatedEngine(slots=4, mean_group_time=0.04, sigma=1.0),
        )
        return time.monotonic() - began

    sync_time, async_time = run(0), run(2)
    assert async_time < 0.8 * sync_time, f"sync {sync_time:.2f} s, async {async_time:.2f} s"


def test_producer_metrics_report_idle_time():
    """A trainer that trains far longer than generation takes waits on nothing (idle ~0) while the engine waits for
    the trainer's next version most of the time (its idle fraction is high)."""
    _, metrics = _run_simulated_training(
        steps=4,
        groups_per_step=2,
        max_staleness=1,
        train_time=0.1,
        engine=SimulatedEngine(slots=4, mean_group_time=0.002, sigma=0.1),
    )
    late = metrics[1:]
    assert max(m["async/trainer_idle_frac"] for m in late) < 0.2
    assert min(m["async/generator_idle_frac"] for m in late) > 0.7


class _FailingSampler:
    def __init__(self, fail_at: int, answer_version: int | None = None):
        self.fail_at = fail_at
        self.answer_version = answer_version

    async def sample(self, request: GroupRequest) -> SampledGroup:
        await asyncio.sleep(0.001)
        if request.index == self.fail_at and self.answer_version is None:
            raise ConnectionError("server gone")
        version = self.answer_version if request.index == self.fail_at else request.version
        return SampledGroup(completion_ids=[[1]] * request.num_generations, logprobs=[[-1.0]], version=version)


def _producer(sampler, max_staleness=1, **overrides) -> RolloutProducer:
    settings = dict(prompt_for=str, max_inflight_tasks=4)
    settings.update(overrides)
    producer = RolloutProducer(
        sampler=sampler,
        score=_length_reward,
        schedule=StalenessSchedule(groups_per_version=1, max_staleness=max_staleness),
        num_generations=2,
        seed=0,
        queue_maxsize=8,
        **settings,
    )
    producer.start()
    producer.publish_version(0)
    return producer


def test_producer_raises_the_samplers_error_in_the_trainer():
    producer = _producer(_FailingSampler(fail_at=1))
    try:
        producer.take(1, timeout=10)
        with pytest.raises(RolloutProducerError, match="server gone"):
            producer.take(1, timeout=10)
    finally:
        producer.close()


def _prompt_that_fails_at_group_2(index: int) -> str:
    if index == 2:
        raise KeyError(f"no prompt for group {index}")
    return str(index)


@pytest.mark.parametrize("failing", ["prompt_for", "seed_for"])
def test_a_crash_in_the_producers_own_scheduling_is_raised_at_once_with_its_traceback(failing):
    """``prompt_for`` and ``seed_for`` run in the scheduling loop, outside any group's task. Group 2's raises: the
    trainer waiting for it gets that error within seconds (not the "server answers too slowly" of a 600 s timeout),
    with the producer thread's traceback naming the function that failed."""

    def seed_that_fails_at_group_2(index: int, version: int, prompt) -> int:
        if index == 2:
            raise KeyError(f"no seed for group {index}")
        return index

    producer = _producer(
        _FailingSampler(fail_at=-1),
        max_staleness=4,
        prompt_for=_prompt_that_fails_at_group_2 if failing == "prompt_for" else str,
        seed_for=seed_that_fails_at_group_2 if failing == "seed_for" else None,
        max_inflight_tasks=1,
    )
    try:
        assert [group.index for group in producer.take(2, timeout=10)] == [0, 1]
        with pytest.raises(RolloutProducerError) as raised:
            producer.take(1, timeout=600)
        message = str(raised.value)
        assert "KeyError" in message and "group 2" in message and "too slowly" not in message
        expected_frame = "_prompt_that_fails_at_group_2" if failing == "prompt_for" else "seed_that_fails_at_group_2"
        assert "In the producer's thread" in message and expected_frame in message
        assert isinstance(raised.value.__cause__, KeyError)
        # Every other wait of the trainer's side raises it too, at once.
        with pytest.raises(RolloutProducerError, match="KeyError"):
            producer.admitted_groups(timeout=600)
    finally:
        producer.close()


def test_producer_refuses_a_group_from_the_wrong_version():
    """The server answered group 0 (trained at v0) from version 3: weights it was never asked for."""
    producer = _producer(_FailingSampler(fail_at=0, answer_version=3))
    try:
        with pytest.raises(RolloutProducerError, match="sampled by version 3"):
            producer.take(1, timeout=10)
    finally:
        producer.close()


def test_producer_times_out_instead_of_hanging():
    class _Silent:
        async def sample(self, request):
            await asyncio.sleep(3600)

    producer = _producer(_Silent())
    try:
        with pytest.raises(TimeoutError, match="raise request_timeout"):
            producer.take(1, timeout=0.5)
    finally:
        producer.close()
    assert not any(thread.name == "trlx-scale-rollout-producer" for thread in threading.enumerate())


def test_simulated_engine_times_are_lognormal_with_the_asked_mean():
    times = [lognormal_duration(seed, mean=2.0, sigma=1.0) for seed in range(4000)]
    assert abs(sum(times) / len(times) - 2.0) < 0.2
    assert max(times) > 6 * 2.0  # the long tail


def test_schedule_after_a_resume_starts_from_the_checkpoints_version():
    """Resumed at version 5 with s=2, w=2, 1 group per version: the servers hold only v5, so groups trained at
    v5-v7 (whose oldest admissible versions are 3-5) are sampled by v5; from v8 on (oldest 6) the schedule is the
    uninterrupted one: v6, v8, v8."""
    resumed = StalenessSchedule(
        1, max_staleness=2, weight_sync_steps=2, start_index=5, start_version=5, oldest_version=5
    )
    straight = StalenessSchedule(1, max_staleness=2, weight_sync_steps=2)
    assert [resumed.sampled_at(k) for k in range(5, 11)] == [5, 5, 5, 6, 8, 8]
    assert [straight.sampled_at(k) for k in range(8, 11)] == [6, 8, 8]


def _trained_groups(producer: RolloutProducer, engine: SimulatedEngine, steps: range, groups_per_step: int):
    """The trainer's loop: each step publishes its version (the weights sync before the rollout), then takes the
    step's groups. A checkpoint after it is taken before the next version is published."""
    taken = []
    for step in steps:
        engine.publish(step)
        producer.publish_version(step)
        taken.extend(producer.take(groups_per_step, timeout=30))
    return taken


def test_a_checkpoints_window_resumes_the_interrupted_schedule(tmp_path):
    """max_staleness=2, 2 groups per step, 6 steps straight; against 3 steps, a checkpoint (the window: groups 6-9,
    trained at v3-v4 and sampled by v1-v2, waited for and saved), then a new producer on an engine that only ever
    has v3 on: the same groups, versions, seeds, completions, log-probs and rewards. queue_maxsize=4 (two steps)
    does not hold the window back. Without the window the resumed engine would be asked for v1, which it lacks."""
    from trlx_scale.rollout.rollout_window import load_window, save_window

    def producer(ready=(), start=0):
        schedule = StalenessSchedule(groups_per_version=2, max_staleness=2, start_index=2 * start, start_version=start)
        return RolloutProducer(
            prompt_for=lambda k: f"prompt-{k}",
            sampler=engine,
            score=_length_reward,
            schedule=schedule,
            num_generations=3,
            seed=7,
            max_inflight_tasks=3,
            queue_maxsize=4,
            ready=ready,
        )

    def key(group):
        return (group.index, group.request.version, group.request.seed, group.sampled.version, group.staleness)

    engine = SimulatedEngine(slots=4, mean_group_time=0.005)
    straight = producer()
    straight.start()
    try:
        whole = _trained_groups(straight, engine, range(6), 2)
    finally:
        straight.close()

    engine = SimulatedEngine(slots=4, mean_group_time=0.005)
    first = producer()
    first.start()
    try:
        before = _trained_groups(first, engine, range(3), 2)[:6]
        window = first.admitted_groups(timeout=30)
    finally:
        first.close()
    assert [group.index for group in window] == [6, 7, 8, 9]
    assert [group.sampled.version for group in window] == [1, 1, 2, 2]
    save_window(str(tmp_path / "window.pt"), window, {"max_staleness": 2})
    settings, loaded = load_window(str(tmp_path / "window.pt"))
    assert settings == {"max_staleness": 2}

    engine = SimulatedEngine(slots=4, mean_group_time=0.005)  # a new server: only the checkpoint's weights on
    resumed = producer(ready=loaded, start=3)
    resumed.start()
    try:
        after = _trained_groups(resumed, engine, range(3, 6), 2)
    finally:
        resumed.close()
    assert [key(group) for group in before + after] == [key(group) for group in whole]
    assert [group.sampled.completion_ids for group in before + after] == [g.sampled.completion_ids for g in whole]
    assert [group.sampled.logprobs for group in before + after] == [group.sampled.logprobs for group in whole]
    assert [group.rewards for group in before + after] == [group.rewards for group in whole]


def test_a_window_keeps_a_multi_turn_groups_messages_and_extras_and_refuses_what_it_cannot_save(tmp_path):
    """A tool group's completions (messages) and its sampler's extras (first turns, masks, counts) come back as they
    were; an extra that torch.load(weights_only=True) could not read back is refused by name and nothing is written."""
    from trlx_scale.rollout.rollout_window import load_window, save_window

    messages = [[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]]
    extras = {"first_turn_ids": [[5, 6]], "tool_masks": [[1, 1, 0, 1]], "tool_stats": {"calls": 1, "seconds": 0.5}}
    sampled = SampledGroup([[5, 6, 7, 8]], [[-0.5, -0.25, 0.0, -1.0]], 0, completions=messages, extras=dict(extras))
    group = ScoredGroup(GroupRequest(0, "p", 1, 0, 3), sampled, [[1.0]], 0)
    save_window(str(tmp_path / "window.pt"), [group], {"max_staleness": 1})
    _, (loaded,) = load_window(str(tmp_path / "window.pt"))
    assert loaded.sampled.completions == messages
    assert {key: loaded.sampled.extras[key] for key in extras} == extras

    sampled.extras["environment"] = object()
    with pytest.raises(TypeError, match="extra 'environment' \\(object\\) is not a plain value"):
        save_window(str(tmp_path / "other.pt"), [group], {"max_staleness": 1})
    assert not (tmp_path / "other.pt").exists()


def test_a_window_of_other_settings_is_not_continued():
    from trlx_scale.rollout.rollout_window import window_mismatch

    saved = {"seed": 1, "max_staleness": 2, "oldest_version": 0}
    assert window_mismatch(saved, {"seed": 1, "max_staleness": 2, "oldest_version": 5}) is None
    assert window_mismatch(saved, {"seed": 1, "max_staleness": 4, "oldest_version": 0}) == (
        "max_staleness was 2 when it was saved, is 4 now"
    )


def test_a_producer_refuses_a_queue_that_does_not_start_at_its_schedule():
    schedule = StalenessSchedule(groups_per_version=1, max_staleness=1, start_index=4, start_version=4)
    group = ScoredGroup(GroupRequest(5, "p", 1, 4, 0), SampledGroup([[1]], [[-1.0]], 4), [[1.0]], 1)
    with pytest.raises(ValueError, match="must be groups \\[4\\]"):
        RolloutProducer(
            prompt_for=str,
            sampler=SimulatedEngine(1, 0.01),
            score=_length_reward,
            schedule=schedule,
            num_generations=1,
            seed=0,
            max_inflight_tasks=1,
            queue_maxsize=1,
            ready=[group],
        )


def test_held_requests_let_a_request_run_alone_at_the_server():
    """hold_requests() returns once no request is at the sampler, and none starts inside the block (the weight probe
    runs alone on vLLM's CPU build, where it crashes a LoRA-enabled engine when batched with sampling requests)."""
    state = {"at_server": 0, "while_held": 0, "held": False}

    class CountingSampler:
        async def sample(self, request):
            state["at_server"] += 1
            if state["held"]:
                state["while_held"] += 1
            await asyncio.sleep(0.02)
            state["at_server"] -= 1
            return SampledGroup(
                completion_ids=[[1]] * request.num_generations, logprobs=[[-1.0]], version=request.version
            )

    producer = RolloutProducer(
        prompt_for=str,
        sampler=CountingSampler(),
        score=_length_reward,
        schedule=StalenessSchedule(groups_per_version=4, max_staleness=3),
        num_generations=2,
        seed=0,
        max_inflight_tasks=16,
        queue_maxsize=64,
    )
    producer.start()
    try:
        producer.publish_version(0)
        time.sleep(0.005)  # requests are at the sampler now
        with producer.hold_requests(timeout=10):
            state["held"] = True
            assert state["at_server"] == 0
            producer.publish_version(1)  # admits more groups: none may start while held
            time.sleep(0.1)
            state["held"] = False
        assert len(producer.take(8, timeout=10)) == 8  # released: the run goes on
    finally:
        producer.close()
    assert state["while_held"] == 0
