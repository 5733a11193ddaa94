"""GRPO for a tool-using agent, sampled through ``twinkle serve`` by an unmodified OpenAI agent loop.

    python examples/agent/tool_grpo.py                 # tiny model, torch engine, ~2 minutes on 2 CPU cores
    python examples/agent/tool_grpo.py --steps 20 --engine vllm

The agent is plain ``openai`` client code: it asks the weather in a city,
runs the ``get_weather`` tool the model calls, and returns the model's
answer. The reward is 1 when the answer repeats the temperature the tool
returned (the tiny model tends to make one up). Each rollout is one server
session; the trainer reads the sessions' token-exact episodes back
(``GET /v1/sessions/{id}``), checks that the trained tokens are exactly the
tokens the server returned to the agent, and takes a clipped policy-gradient
step on a LoRA adapter over the sampled tokens of both turns (the tool
result and the template's tokens are masked out). The adapter is pushed into
the same sampler while the server keeps running, and the agent selects it by
``model="policy"``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from twinkle_core import create_sampler
from twinkle_core.server import start_server
from twinkle_core.testing import build_tiny_model

CITIES = ["Paris", "Rome", "Madrid", "Tokyo", "Cairo", "Lima", "Oslo", "Athens"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def agent(client: openai.OpenAI, session: str, city: str, degrees: int, max_tokens: int) -> dict[str, Any]:
    """One rollout of an ordinary OpenAI tool loop; returns what it saw and its reward."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather in {city}?"}]
    seen: list[list[int]] = []
    called = False
    for _ in range(3):
        r = client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[WEATHER],
            temperature=1.0,
            max_tokens=max_tokens,
            extra_headers={"X-Session-Id": session},
        )
        msg = r.choices[0].message
        seen.append(r.choices[0].model_extra["token_ids"])
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        called = True
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{degrees} degrees and sunny"})
    answer = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
    return {"session": session, "tokens": seen, **rewards(called, answer, degrees)}


def rewards(called: bool, answer: str, degrees: int) -> dict[str, float]:
    """``success``: the tool was called and the answer's first number is the tool's. ``shaped`` adds
    half a point for a first number that starts with the right digit: a step on the way to copying it,
    which gives a group of rollouts a spread of rewards far more often than success alone does."""
    numbers = re.findall(r"\d+", answer)
    first = numbers[0] if called and numbers else ""
    success = float(first == str(degrees))
    partial = 0.5 * float(not success and first[:1] == str(degrees)[:1] and bool(first))
    return {"success": success, "shaped": success + partial}


def token_logprobs(model: Any, ids: list[list[int]], labels: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-prob of each labelled token (labels unshifted, ``-100`` elsewhere)."""
    width = max(len(x) for x in ids)
    x = torch.zeros(len(ids), width, dtype=torch.long)
    y = torch.full_like(x, -100)
    attn = torch.zeros_like(x)
    for i, (a, b) in enumerate(zip(ids, labels)):
        x[i, : len(a)], y[i, : len(b)], attn[i, : len(a)] = torch.tensor(a), torch.tensor(b), 1
    logp = torch.log_softmax(model(input_ids=x, attention_mask=attn).logits[:, :-1].float(), dim=-1)
    target = y[:, 1:]
    mask = target != -100
    return logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask, mask


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train; return one row of metrics per step (also printed as JSON lines)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="torch")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--warmup", type=int, default=2, help="steps of linear learning-rate warm-up")
    ap.add_argument("--kl", type=float, default=0.05, help="weight of the KL penalty to the initial model")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: none)")
    ap.add_argument("--reward", choices=["shaped", "success"], default="shaped", help="the reward trained on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None, help="write metrics.jsonl (and curves.png) here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model_dir = build_tiny_model("llama")
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), lora)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optim = torch.optim.Adam(trainable, lr=args.lr)
    # Warm up, then a cosine decay to a tenth: the first steps see the noisiest advantages, the last
    # ones should not undo what was learned (a constant 1e-2 rose, then collapsed).
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda k: (
            (k + 1) / args.warmup
            if k < args.warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (k - args.warmup) / max(1, args.steps - args.warmup)))
        ),
    )
    history: list[dict[str, Any]] = []
    sampler = create_sampler(args.engine, model_id=str(model_dir))

    def push() -> int:
        weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()}
        return sampler.add_adapter_to_model("policy", lora, weights=weights)

    version = push()
    with sampler, start_server(sampler, log_level="error") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for step in range(args.steps):
            jobs = [(rng.choice(CITIES), rng.randrange(5, 35)) for _ in range(args.prompts)]
            results: list[dict[str, Any]] = [{} for _ in range(args.prompts * args.group)]

            def run(k: int, city: str, degrees: int, out: list[dict[str, Any]] = results, step: int = step) -> None:
                out[k] = agent(client, f"step{step}-{k}", city, degrees, args.max_tokens)

            threads = [
                threading.Thread(target=run, args=(p * args.group + g, *jobs[p]))
                for p in range(args.prompts)
                for g in range(args.group)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

            ids, labels, sampler_lp = [], [], []
            for res in results:
                [record] = httpx.get(f"{server.url}/v1/sessions/{res['session']}").json()["data"]
                feat = record["feature"]
                mask = feat["extra"]["loss_mask"]
                trained = [t for t, m in zip(feat["input_ids"], mask) if m]
                # Token-exact: what the trainer trains on is what the agent was sent, nothing else.
                assert trained == [t for turn in res["tokens"] for t in turn], res["session"]
                assert all(t["weights_version"] == version for t in feat["extra"]["turns"])
                ids.append(feat["input_ids"])
                labels.append(feat["labels"])
                sampler_lp.append([lp if m else 0.0 for lp, m in zip(feat["extra"]["logprobs"], mask)])
                httpx.delete(f"{server.url}/v1/sessions/{res['session']}")
            reward = torch.tensor([r[args.reward] for r in results]).view(args.prompts, args.group)
            # Normalised within each prompt's group; the floor on the std keeps one lucky rollout in a
            # group of failures from getting an advantage of sqrt(group) times its neighbours'.
            adv = (
                (reward - reward.mean(1, keepdim=True)) / reward.std(1, unbiased=False, keepdim=True).clamp(min=0.2)
            ).view(-1)

            policy.train()
            new_lp, mask = token_logprobs(policy, ids, labels)
            width = mask.shape[1]
            old = torch.tensor([row[1 : width + 1] + [0.0] * (width + 1 - len(row)) for row in sampler_lp])
            mismatch = (new_lp.detach() - old).abs()[mask]
            ratio = torch.exp(new_lp - old)
            obj = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
            loss = -(obj * mask).sum() / mask.sum()
            kl = torch.zeros(())
            if args.kl > 0:
                # k3 estimator of KL(policy || initial model) on the sampled tokens: keeps the policy near
                # the model that still calls the tool, whose loss of that habit zeroes every reward.
                with torch.no_grad(), policy.disable_adapter():
                    ref_lp, _ = token_logprobs(policy, ids, labels)
                diff = (ref_lp - new_lp) * mask
                kl = ((torch.exp(diff) - diff - 1) * mask).sum() / mask.sum()
                loss = loss + args.kl * kl
            optim.zero_grad()
            loss.backward()
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(trainable, args.clip_grad)
            optim.step()
            sched.step()
            version = push()
            row = {
                "step": step,
                "success": round(float(torch.tensor([r["success"] for r in results]).mean()), 4),
                "shaped": round(float(torch.tensor([r["shaped"] for r in results]).mean()), 4),
                "kl": float(kl.detach()),
                "mismatch_max": float(mismatch.max()),
                "lr": optim.param_groups[0]["lr"],
                "weights_version": version,
            }
            history.append(row)
            print(json.dumps(row), flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    if args.out is not None:
        plot(history, args.out / "curves.png")
    first, last = history[: max(1, len(history) // 4)], history[-max(1, len(history) // 4) :]
    print(
        f"success: first {len(first)} steps {sum(r['success'] for r in first) / len(first):.3f}"
        f" -> last {len(last)} steps {sum(r['success'] for r in last) / len(last):.3f}"
    )
    return history


def plot(history: list[dict[str, Any]], path: Path) -> None:
    """Reward and success per step, and the sampler/trainer log-prob gap, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, [r["shaped"] for r in history], label="shaped reward (trained on)")
    top.plot(steps, [r["success"] for r in history], label="success: answer repeats the tool's number")
    top.set_ylabel("mean over rollouts")
    top.legend(loc="upper left")
    bottom.semilogy(steps, [max(r["mismatch_max"], 1e-9) for r in history])
    bottom.set_ylabel("max |sampler - trainer| log-prob")
    bottom.set_xlabel("step")
    fig.suptitle("GRPO through twinkle serve: tool-using agent, tiny model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
