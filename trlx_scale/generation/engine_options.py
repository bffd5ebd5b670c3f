"""The colocated engine's options and their rules, each in one place.

The config fields (``config_fields.py``) list these choices in their metadata (so ``--help`` shows them) and
run these checks in ``__post_init__``, so a bad value fails before anything loads; the engine and its components run
the same functions when they are built directly.
"""

from __future__ import annotations

SYNC_MODES = ("auto", "lora", "full")
RESOLVED_SLEEP_LEVELS = ("1", "2")
SLEEP_LEVELS = ("auto", *RESOLVED_SLEEP_LEVELS)
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")  # what vllm.LLM takes
ENGINE_DTYPES = ("auto", "trainer", *VLLM_DTYPES[1:])  # the config field: "trainer" resolves to one of the above


def check_choice(field: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{field} must be one of {choices}, got {value!r}.")
    return value


def check_sync_mode(value: str) -> str:
    return check_choice("vllm_sync_mode", value, SYNC_MODES)


def check_sleep_level(value: str | int) -> str:
    """'auto', '1' or '2' (an int 1 or 2 is accepted and normalised)."""
    return check_choice("vllm_sleep_level", str(value), SLEEP_LEVELS)


def check_resolved_sleep_level(value: int | str) -> int:
    """A level the engine runs with: 1 or 2."""
    return int(check_choice("sleep_level", str(value), RESOLVED_SLEEP_LEVELS))


def resolve_sleep_level(value: str | int, sync_mode: str) -> int:
    """The level a sleeping engine uses: 'auto' is 1 for LoRA-only sync (the base never changes, so it waits in host
    RAM and is never re-sent) and 2 for full sync (every weight is pushed again anyway)."""
    level = check_sleep_level(value)
    if level == "auto":
        return 1 if sync_mode == "lora" else 2
    return int(level)


def check_engine_dtype(value: str) -> str:
    return check_choice("vllm_dtype", value, ENGINE_DTYPES)


def check_vllm_dtype(value: str) -> str:
    return check_choice("dtype", value, VLLM_DTYPES)


def check_positive(field: str, value: float, hint: str = "") -> float:
    if not value > 0:
        raise ValueError(f"{field} must be a positive number, got {value}.{(' ' + hint) if hint else ''}")
    return value


def check_kvcache_space(value: float) -> float:
    return check_positive("vllm_cpu_kvcache_space", value, "It is GiB of host memory; 1 is plenty for small models.")


def check_tensor_parallel_layout(tp: int, world: int, local_world: int) -> None:
    """A tensor-parallel group of the colocated engine is consecutive ranks, and must live on one node: vLLM
    all-reduces inside it at every decoding step, which across nodes would crawl (or hang without a shared network)."""
    if world % tp != 0:
        raise ValueError(
            f"vllm_tensor_parallel_size ({tp}) must divide the number of processes ({world}); choose a divisor."
        )
    if tp > 1 and (tp > local_world or local_world % tp != 0):
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} would put a tensor-parallel group across nodes: each node runs "
            f"{local_world} processes. Choose a vllm_tensor_parallel_size that divides the processes per node "
            f"({local_world})."
        )
