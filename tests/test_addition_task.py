from trlx_scale.tasks.addition import addition_dataset, completion_text, exact_match_reward, split_problems


def test_split_is_disjoint_complete_and_deterministic():
    train, held_out = split_problems()
    assert len(train) + len(held_out) == 100 * 100
    assert len(held_out) == 2000  # every 5th of 10000
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in held_out}
    again_train, again_held_out = split_problems()
    assert train == again_train and held_out == again_held_out


def test_dataset_columns_and_formats():
    chat = addition_dataset("held_out", size=3)
    assert chat.column_names == ["prompt", "answer"]
    first = chat[0]
    a, b = first["prompt"][0]["content"].rstrip("=").split("+")
    assert first["prompt"][0]["role"] == "user"
    assert first["answer"] == str(int(a) + int(b))
    text = addition_dataset("train", size=2, conversational=False)
    assert isinstance(text[0]["prompt"], str) and text[0]["prompt"].endswith("=")


def test_dataset_rejects_bad_arguments():
    import pytest

    with pytest.raises(ValueError, match="split must be 'train' or 'held_out'"):
        addition_dataset("test")
    with pytest.raises(ValueError, match="size must be a positive"):
        addition_dataset("train", size=0)


def test_exact_match_reward_in_both_completion_formats():
    completions = ["46", " 46 ", "47", "46 apples", [{"role": "assistant", "content": "46"}], ""]
    rewards = exact_match_reward(completions, answer=["46"] * len(completions))
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": "1"}, {"role": "assistant", "content": "2"}]) == "12"
