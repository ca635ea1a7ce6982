"""Play the held-out problems greedily with a model directory or checkpoint, in this process.

    python -m recipes.tiny_tools.check --model DIR [--heldout-size N]

prints one JSON line: `heldout_accuracy`, `heldout_tool_call_rate`, `heldout_correct_tool_call_rate`
(recipes/tiny_tools/episodes.py says what each counts). The demo calls `check` on the run's last
checkpoint, in its own process: greedy decoding draws no random numbers, and the torch thread count is
pinned to the warm start's for the call (a CPU reduction's order, hence its bits, follows the thread
count) and restored after it.
"""
from __future__ import annotations

import argparse
import json
import sys


def check(model_dir: str, *, heldout_size: int | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.tiny_tools import TASK_OPTIONS, WARM_START
    from recipes.tiny_tools.prepare import heldout_report
    from recipes.char_tokenizer import build_char_tokenizer
    from services.coordinator.tasks.episodic import CalculatorConfig, CalculatorTask

    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_START.num_threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
        task = CalculatorTask(CalculatorConfig.model_validate(TASK_OPTIONS, strict=False))
        return heldout_report(model, build_char_tokenizer(), task, heldout_size).as_dict("heldout_")
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="A model directory or a trainer checkpoint (HF layout).")
    p.add_argument("--heldout-size", type=int, default=None,
                   help="Play the first N held-out problems (default: all), like the run's eval.heldout_size.")
    args = p.parse_args(argv)
    if args.heldout_size is not None and args.heldout_size < 1:
        p.error(f"--heldout-size: must be >= 1, got {args.heldout_size}")
    print(json.dumps(check(args.model, heldout_size=args.heldout_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
