"""TRL's ``GRPOTrainer`` on CPU, three generators side by side in one run, same config.

    python bench/bench_trl.py                                   # SmolLM2-135M-Instruct, 3 steps per arm
    python bench/bench_trl.py --model tiny --steps 3            # a quick check of the script

Arms, each a fresh trainer from the same weights, dataset and seed:

* ``trl-generate``: TRL's default generation (``model.generate``);
* ``trl-cb``: TRL's ``use_transformers_continuous_batching=True`` (``generate_batch``);
* ``twinkle``: ``rollout_func=TwinkleRollout(sampler)`` on twinkle's torch engine, which
  also pushes the weights every step and checks the sampler against the trainer.

Per arm: generation seconds per step (the time TRL spends producing the batch's
completions, measured around the trainer's generation call), generated tokens
per second (TRL's logged completion lengths over that time), and the whole
step's time (TRL's ``step_time``). The first step of each arm is a warm-up and
is left out of the medians. Everything runs in float32 (``bf16=False``), so the
three arms do the same arithmetic.

The sampler/trainer gap: for ``twinkle``, the largest difference between the
sampler's and the trainer's log-prob of a sampled token on the integration's
checked completions; for TRL's own generators TRL records no sampling
log-probs, so the script measures ``model.generate``'s the same way on one
batch of the same prompts (``output_logits``), after the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "grpo"))

from tasks import make_task
from trl_grpo import dataset_for, grpo_config, model_path, reward_for


def run_arm(arm: str, path: str, a: argparse.Namespace, sampler: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from twinkle_core.integrations.trl import TwinkleRollout

    torch.manual_seed(a.seed)
    rollout = TwinkleRollout(sampler) if arm == "twinkle" else None
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=reward_for(a.task),
        args=grpo_config(
            a,
            f"/tmp/bench_trl/{arm}",
            bf16=False,
            disable_tqdm=True,
            use_transformers_continuous_batching=arm == "trl-cb",
        ),
        train_dataset=dataset_for(a.task, a.steps * a.prompts, a.seed),
        processing_class=AutoTokenizer.from_pretrained(path),
        rollout_func=rollout,
    )
    # measurement hook: the seconds of each generation call (the same method in every arm)
    generate_s: list[float] = []
    inner = trainer._generate

    def timed(prompts: list[Any]) -> Any:
        t = time.perf_counter()
        try:
            return inner(prompts)
        finally:
            generate_s.append(time.perf_counter() - t)

    trainer._generate = timed
    trainer.train()
    logs = [row for row in trainer.state.log_history if "step_time" in row]
    n = a.prompts * a.generations
    tok_s = [row["completions/mean_length"] * n / g for row, g in zip(logs, generate_s)]
    keep = slice(1, None) if len(logs) > 1 else slice(None)
    result = {
        "arm": arm,
        "generate_s": statistics.median(generate_s[keep]),
        "tok_s": statistics.median(tok_s[keep]),
        "step_s": statistics.median([row["step_time"] for row in logs][keep]),
        "reward": [round(row["reward"], 3) for row in logs],
    }
    if rollout is not None:
        result["gap_max"] = max(h["logp_diff_max"] for h in rollout.history)
    print(json.dumps(result), flush=True)
    return result


def generate_gap(path: str, a: argparse.Namespace) -> float:
    """``model.generate``'s sampling log-probs against a fresh forward of the same tokens (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle_core.integrations.trl import _model_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    rows = make_task(a.task).batch(random.Random(a.seed), a.prompts)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in rows]
    batch = tok(prompts * a.generations, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(a.seed)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=a.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=a.max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    width = batch["input_ids"].shape[1]
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    worst = 0.0
    for i in range(out.sequences.shape[0]):
        prompt = [t for t, m in zip(batch["input_ids"][i].tolist(), batch["attention_mask"][i].tolist()) if m]
        completion = []
        sampled = []
        for j, t in enumerate(out.sequences[i, width:].tolist()):
            completion.append(t)
            sampled.append(torch.log_softmax(out.logits[j][i].float() / a.temperature, -1)[t].item())
            if t in eos:
                break
        fresh = _model_logprobs(model, [(prompt, completion)], a.temperature)[0]
        worst = max(worst, max(abs(x - y) for x, y in zip(fresh, sampled)))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin://smollm2-135m-instruct")
    p.add_argument("--task", default="extract")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="trl-generate,trl-cb,twinkle")
    a = p.parse_args()

    from twinkle_core import create_sampler

    path = model_path(a.model)
    print(
        f"# {Path(path).name}: {a.steps} GRPO steps per arm, {a.prompts} prompts x {a.generations} generations,"
        f" up to {a.max_tokens} tokens, T={a.temperature}, float32, torch {__import__('torch').__version__},"
        f" trl {__import__('trl').__version__}",
        flush=True,
    )
    results = []
    with create_sampler("torch", model_id=path) as sampler:
        for arm in a.arms.split(","):
            results.append(run_arm(arm, path, a, sampler))
    gap = generate_gap(path, a) if any(r["arm"] != "twinkle" for r in results) else None
    base = next((r for r in results if r["arm"] == "twinkle"), None)
    print(f"\n{'arm':<14}{'gen s/step':>12}{'gen tok/s':>11}{'step s':>9}{'twinkle tok/s ratio':>21}{'gap max':>10}")
    for r in results:
        ratio = f"{base['tok_s'] / r['tok_s']:.2f}x" if base else "-"
        g = r.get("gap_max", gap)
        print(
            f"{r['arm']:<14}{r['generate_s']:>12.2f}{r['tok_s']:>11.1f}{r['step_s']:>9.2f}{ratio:>21}"
            f"{'-' if g is None else format(g, '.1e'):>10}"
        )


if __name__ == "__main__":
    main()
