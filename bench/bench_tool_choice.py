"""Forced tool calls against unconstrained decoding on the torch engine: the same prompts, one table.

    python bench/bench_tool_choice.py                      # torch on SmolLM2-135M

A forced call (``tool_choice`` ``"required"``, or a named function) is a
grammar in the model's tool-call syntax (:mod:`twinkle_core.tool_choice`), run
as the turn's ``structured_outputs``. Each runner samples the same chat
prompts in its own process: unconstrained (``ignore_eos``, so every
completion runs the whole budget), and under the grammar ``twinkle serve``
builds for ``tool_choice="required"`` and for a named function, over one tool
whose free-text argument lets the model write for as long as it likes (so a
call is about as long as the budget; a call that closes earlier ends the
turn, as a served turn does). The table's ratio is tokens/s against the
unconstrained run: issue 60's target is that a constrained turn costs at
most 1.25x an unconstrained turn of the same length, a ratio of at least 0.8.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness import BENCH_PROMPTS, Runner, Workload, compare

#: One tool whose string argument can run for the whole budget.
NOTE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Write a note.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def grammar(tool_choice: Any) -> str:
    """The grammar ``twinkle serve`` constrains a turn with for ``tool_choice`` over :data:`NOTE`."""
    from twinkle_core.tool_choice import tool_constraint
    from twinkle_core.tools import get_tool_parser

    constraint = tool_constraint(get_tool_parser("hermes"), [NOTE], tool_choice, None)
    assert constraint is not None
    return constraint.grammar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Forced tool calls against unconstrained decoding (torch engine).")
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    base = {"engine": "torch", "device": "cpu"}
    choices = {"required": "required", "named": {"type": "function", "function": {"name": "write_note"}}}
    runners = [Runner("torch-plain", "harness:sampler_runner", base)]
    for label, choice in choices.items():
        sampling = {"structured_outputs": {"grammar": grammar(choice)}}
        runners.append(Runner(f"torch-tool-{label}", "harness:sampler_runner", {**base, "sampling": sampling}))
    workload = Workload(
        name="smollm2",
        model_id=args.model,
        prompts=BENCH_PROMPTS[: args.prompts],
        max_tokens=args.max_tokens,
        num_samples=2,
        ignore_eos=True,
    )
    results = compare(
        runners, [workload], baseline="torch-plain", repeats=args.repeats, rounds=args.rounds, threads=args.threads
    )
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
