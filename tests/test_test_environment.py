"""The suite's own hygiene: a test's environment changes do not reach the next test (conftest's autouse fixture).

The two tests run in file order: the first leaves what a colocated engine exports, the second must not see it."""

import os

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_PORT")


def test_an_engine_exports_the_launcher_layout(default_model_dir, tmp_path):
    from trlx_scale import GRPOTrainer
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    from .helpers.trainers import small_grpo_config

    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    trainer = GRPOTrainer(
        default_model_dir,
        exact_match_reward,
        small_grpo_config(tmp_path, use_vllm=True, vllm_mode="colocate", max_steps=1),
        train_dataset=addition_dataset("train", size=8),
    )
    assert trainer.vllm_generation is not None
    assert all(os.environ.get(name) is not None for name in LAUNCHER_VARIABLES)
    os.environ["TRLX_SCALE_TEST_LEFTOVER"] = "1"
    test_an_engine_exports_the_launcher_layout.before = before


def test_the_next_test_starts_with_the_environment_it_had():
    before = test_an_engine_exports_the_launcher_layout.before
    assert "TRLX_SCALE_TEST_LEFTOVER" not in os.environ
    assert {name: os.environ.get(name) for name in LAUNCHER_VARIABLES} == before
