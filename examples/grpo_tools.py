# Copyright trlx_scale contributors. Apache-2.0.
"""GRPO with a tool, offline on CPU: the embedded tool model learns to call its calculator more often.

    python examples/grpo_tools.py                      # embedded tool model + calculator task, vLLM colocated
    python examples/grpo_tools.py --max_steps 40 --seed 1
    trlx-scale grpo --task calculator_tools            # the same run from the installed package
    trlx-scale async_grpo --task calculator_tools      # the asynchronous trainer (a vLLM server it starts)

The task is the sum of three three-digit numbers (``trlx_scale.tasks.calculator_task``), which the tiny embedded model
cannot compute in its head but solves nearly always through one call of ``add``. Pre-trained on a mix of both
behaviours (``trlx_scale.tasks.tool_model``), it calls the tool on about half the problems; GRPO with ``tools=[add]``
and an exact-answer reward teaches it to call it on more. Held-out accuracy (greedy, the tool executed) is printed
before and after training. This is `trlx-scale grpo --task calculator_tools`: every field of `trlx_scale.GRPOConfig`
is a flag (`--help`), and the task's defaults are in `trlx_scale.tasks.calculator_tool_run`.
"""

from __future__ import annotations

import os
import sys

# Allow `python examples/grpo_tools.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.scripts import grpo  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """The summary of the run (``RunSummary``: held-out accuracy before and after, training time, ...)."""
    argv = sys.argv[1:] if argv is None else argv
    return grpo.main(["--task", "calculator_tools", "--output_dir", "outputs/grpo-tools", *argv])


if __name__ == "__main__":
    run_then_exit(main)
