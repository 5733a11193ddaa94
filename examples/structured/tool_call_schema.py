"""Constrain a tool call to its JSON schema; replay the constraint on the trainer side.

    python examples/structured/tool_call_schema.py                    # SmolLM2-135M, torch engine
    python examples/structured/tool_call_schema.py --model tiny       # the tiny test model (plumbing only)

An agent asks the model for a ``multiply`` call as JSON. Sampled freely, a
small model often writes something that does not parse, or parses without the
call's shape: the rollout is wasted. With ``structured_outputs={"json":
schema}`` every completion that finishes is a valid call (one cut by
``max_tokens`` is the start of one).

Constrained decoding is also where the sampler and the trainer disagree
most: the sampler drew each token from the tokens the grammar allowed, a
trainer scoring it over the whole vocabulary puts the grammar's forbidden
mass back in the normaliser. The sampler's ``sampling_mask`` holds the allowed
set per position, and ``twinkle_core.rl.replay_logprobs`` scores over exactly
it: the mismatch falls to float rounding.

Prints, for both runs: the share of completions that are a valid call, and
the mean absolute difference between the sampler's log-probs and the
trainer's, with and without the mask.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from twinkle_core import SamplingParams, create_sampler
from twinkle_core.rl import replay_logprobs
from twinkle_core.testing import build_tiny_model

#: The call the agent wants, as a JSON schema (what an OpenAI tool's ``parameters`` plus its name give).
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "multiply"},
        "arguments": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

QUESTIONS = [f"What is {a} times {b}?" for a, b in [(12, 31), (7, 45), (23, 19), (64, 8), (15, 15), (9, 77)]]
SYSTEM = (
    "You call tools by writing one JSON object and nothing else, e.g. "
    '{"name": "multiply", "arguments": {"a": 2, "b": 3}}.'
)


def is_valid_call(text: str) -> bool:
    """Whether ``text`` is a ``multiply`` call with two integer arguments (the schema, checked by hand)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(call, dict) or call.get("name") != "multiply" or set(call) != {"name", "arguments"}:
        return False
    args = call["arguments"]
    return (
        isinstance(args, dict)
        and set(args) == {"a", "b"}
        and all(isinstance(v, int) and not isinstance(v, bool) for v in args.values())
    )


def trainer_logits(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's logits for each completion token: a plain forward of prompt + completion."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def run(model_id: str, samples: int, max_tokens: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Both runs; per run the valid-call share and the two mismatches (mean absolute log-prob difference)."""
    from transformers import AutoModelForCausalLM

    out: dict[str, dict[str, float]] = {}
    with create_sampler("torch", model_id=model_id, dtype="float32") as sampler:
        trainer = AutoModelForCausalLM.from_pretrained(str(sampler.engine.model_path), dtype=torch.float32).eval()
        prompts = [
            {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]} for q in QUESTIONS
        ]
        for label, structured in (("free", None), ("schema", {"json": CALL_SCHEMA})):
            params = SamplingParams(
                temperature=1.0,
                max_tokens=max_tokens,
                num_samples=samples,
                seed=seed,
                logprobs=0,
                return_sampling_mask=True,
                structured_outputs=structured,
            )
            valid = total = finished = 0
            full_gap: list[float] = []
            replay_gap: list[float] = []
            for response in sampler.sample(prompts, params):
                for seq in response.sequences:
                    total += 1
                    valid += is_valid_call(seq.text)
                    finished += seq.stop_reason == "stop"
                    if not seq.tokens:
                        continue
                    logits = trainer_logits(trainer, response.prompt_token_ids, seq.tokens)
                    sampled = torch.tensor(seq.logprobs)
                    full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.tokens)[:, None]).squeeze(-1)
                    assert seq.sampling_mask is not None
                    replayed = replay_logprobs(logits, seq.tokens, seq.sampling_mask, params)
                    full_gap.append(float((full - sampled).abs().mean()))
                    replay_gap.append(float((replayed - sampled).abs().mean()))
            out[label] = {
                "valid_calls": valid / total,
                "finished": finished / total,
                "mismatch_full_vocab": sum(full_gap) / max(1, len(full_gap)),
                "mismatch_with_mask": sum(replay_gap) / max(1, len(replay_gap)),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct", help="a model id, or 'tiny'")
    parser.add_argument("--samples", type=int, default=4, help="completions per question")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    model = str(build_tiny_model("llama")) if args.model == "tiny" else args.model
    results = run(model, args.samples, args.max_tokens)
    print(f"{'run':<8} {'finished':>9} {'valid calls':>12} {'|sampler - trainer| full vocab':>32} {'with mask':>12}")
    for label, r in results.items():
        print(
            f"{label:<8} {r['finished']:>9.0%} {r['valid_calls']:>12.0%} {r['mismatch_full_vocab']:>32.2e}"
            f" {r['mismatch_with_mask']:>12.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
