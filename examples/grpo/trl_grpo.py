"""GRPO with TRL's ``GRPOTrainer``, twinkle generating: the recipe of ``docs/trl.md``, runnable.

    python examples/grpo/trl_grpo.py                                   # tiny model, full fine-tune, torch engine
    python examples/grpo/trl_grpo.py --mode lora
    python examples/grpo/trl_grpo.py --model builtin://smollm2-135m-instruct --task extract --mode lora \\
        --steps 16 --lr 3e-4 --max-tokens 6 --temperature 1.0
    python examples/grpo/trl_grpo.py --engine vllm

Writes ``metrics.json`` (TRL's log history, with the integration's ``twinkle/*`` figures) and
``reward.png`` to ``--out``. The tasks are this folder's (``tasks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo import _model_dir
from tasks import make_task

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_path(model: str) -> str:
    """'tiny' (built offline) or a model id, as the GRPO example resolves it."""
    return str(_model_dir(model))


def reward_for(task_name: str) -> Any:
    task = make_task(task_name)

    def reward(completions: list[Any], info: list[str], **kwargs: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(t, json.loads(i)) for t, i in zip(texts, info)]

    reward.__name__ = task_name
    return reward


def dataset_for(task_name: str, n: int, seed: int) -> Any:
    from datasets import Dataset

    rows = make_task(task_name).batch(random.Random(seed), n)
    return Dataset.from_dict({"prompt": [m for m, _ in rows], "info": [json.dumps(i) for _, i in rows]})


def grpo_config(a: argparse.Namespace, output_dir: str, **overrides: Any) -> Any:
    """The ``GRPOConfig`` of a run from this script's options (``--prompts``, ``--generations``, ...)."""
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": a.prompts * a.generations,
        "num_generations": a.generations,
        "max_completion_length": a.max_tokens,
        "temperature": a.temperature,
        "learning_rate": a.lr,
        "max_steps": a.steps,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "seed": a.seed,
    }
    return GRPOConfig(**{**settings, **overrides})


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (built offline) or a model id, e.g. builtin://...")
    p.add_argument("--engine", default="torch")
    p.add_argument("--task", default="digits")
    p.add_argument("--mode", choices=["full", "lora"], default="full")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="num_generations")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    # TRL's default is bf16=True; on a CPU without native bfloat16 its autocast makes each step far slower
    p.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast (TRL's default)")
    p.add_argument("--out", default="out/trl_grpo")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from twinkle_core import create_sampler
    from twinkle_core.integrations.trl import TwinkleRollout

    path = model_path(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config = None
    if a.mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0)
    with create_sampler(a.engine, model_id=path) as sampler:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            reward_funcs=reward_for(a.task),
            args=grpo_config(a, str(out), bf16=a.bf16),
            train_dataset=dataset_for(a.task, a.steps * a.prompts, a.seed),
            processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=peft_config,
            rollout_func=TwinkleRollout(sampler),
        )
        trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    (out / "metrics.json").write_text(json.dumps(history, indent=1))
    plot(history, out / "reward.png", f"TRL GRPO + twinkle ({a.engine}), {Path(path).name}, {a.mode}")
    first, last = history[:3], history[-3:]
    print(
        f"reward: first 3 steps {sum(r['reward'] for r in first) / len(first):.3f} -> last 3 steps"
        f" {sum(r['reward'] for r in last) / len(last):.3f}; max sampler/trainer log-prob difference"
        f" {max(r['twinkle/sampling_logp_difference/max'] for r in history):.2e}; metrics in {out}"
    )
    return history


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["reward"] for r in history], marker="o", ms=3)
    ax1.set(xlabel="step", ylabel="mean reward", title="reward")
    ax2.semilogy(steps, [max(r["twinkle/sampling_logp_difference/max"], 1e-9) for r in history], marker="o", ms=3)
    ax2.set(xlabel="step", ylabel="|trainer - sampler| (max, nats)", title="log-prob difference on checked tokens")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
