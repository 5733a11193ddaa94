"""GRPO for a tool-using agent, sampled through ``twinkle serve`` by an unmodified OpenAI agent loop.

    python examples/agent/tool_grpo.py --out out/tool_grpo       # SmolLM2-135M, torch engine, 20 steps, ~30 min
    python examples/agent/tool_grpo.py --model tiny --steps 2    # the tiny test model: the plumbing only

The agent is plain ``openai`` client code: it asks the model a
multiplication, runs the ``multiply`` tool with the arguments the model gives
it, and returns the model's answer. Each rollout is one server session; the
trainer reads the sessions' token-exact episodes back
(``GET /v1/sessions/{id}``), checks that the trained tokens are exactly the
tokens the server returned to the agent, and takes a clipped policy-gradient
step on a LoRA adapter over the sampled tokens of every turn (the tool
result and the template's tokens are masked out). The adapter is pushed into
the same sampler while the server keeps running, and the agent selects it by
``model="policy"``.

Reward: half a point for calling ``multiply`` with the question's two
numbers, half a point for then answering with the product (``success``).
A 135M model cannot multiply two-digit numbers in its head, so the answer
is right only through the tool.
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

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
#: The conversation every rollout starts from: one worked example of the tool loop, then the question.
#: SmolLM2-135M never calls a tool from the tool list alone (0 of 12 samples); after this example it
#: starts a call now and then, which gives GRPO something to reinforce.
FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant with a calculator."},
    {"role": "user", "content": "What is 12 times 31?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 12, "b": 31}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "372"},
    {"role": "assistant", "content": "12 times 31 is 372."},
]


def multiply(arguments: Any) -> str:
    """The tool: the product of ``a`` and ``b``, or an error message the model reads."""
    try:
        return str(int(arguments["a"]) * int(arguments["b"]))
    except (TypeError, KeyError, ValueError):
        return 'error: expected {"a": <integer>, "b": <integer>}'


def agent(client: openai.OpenAI, session: str, a: int, b: int, max_tokens: int) -> dict[str, Any]:
    """One rollout of an ordinary OpenAI tool loop; returns what it saw and its reward."""
    messages: list[dict[str, Any]] = [*FEW_SHOT, {"role": "user", "content": f"What is {a} times {b}?"}]
    seen: list[list[int]] = []
    calls: list[Any] = []
    first = ""
    for _ in range(3):
        r = client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[MULTIPLY],
            temperature=1.0,
            max_tokens=max_tokens,
            extra_headers={"X-Session-Id": session},
        )
        msg = r.choices[0].message
        seen.append(r.choices[0].model_extra["token_ids"])
        if len(seen) == 1:
            first = (msg.content or "") + ("<tool_call>" if msg.tool_calls else "")
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            calls.append((call.function.name, arguments))
            result = multiply(arguments) if call.function.name == "multiply" else f"error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
    return {"session": session, "tokens": seen, **rewards(first, calls, answer, a, b)}


def rewards(first: str, calls: list[Any], answer: str, a: int, b: int) -> dict[str, float]:
    """Steps on the way to a right answer, each worth a share of ``shaped`` (the reward trained on):

    * ``tried`` (0.25): the first reply starts a ``<tool_call>`` (well formed or not);
    * ``called`` (0.25): a ``multiply`` call with the question's two numbers was parsed and run;
    * ``success`` (0.5): after that call, the answer holds the product.
    """
    tried = first.lstrip().startswith("<tool_call>")
    called = any(
        name == "multiply"
        and isinstance(args, dict)
        and sorted(str(v) for v in args.values()) == sorted([str(a), str(b)])
        for name, args in calls
    )
    success = called and str(a * b) in re.findall(r"\d+", answer.replace(",", ""))
    return {
        "tried": float(tried),
        "called": float(called),
        "success": float(success),
        "shaped": 0.25 * tried + 0.25 * called + 0.5 * success,
    }


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
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct", help="a model id, or 'tiny'")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=2, help="steps of linear learning-rate warm-up")
    ap.add_argument("--kl", type=float, default=0.05, help="weight of the KL penalty to the initial model")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: none)")
    ap.add_argument("--reward", choices=["shaped", "success"], default="shaped", help="the reward trained on")
    ap.add_argument("--micro-batch", type=int, default=4, help="rollouts per forward/backward pass")
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
    if args.model == "tiny":
        model_dir, template = build_tiny_model("llama"), None
    else:
        from twinkle_core.hub import resolve_model_id

        # ChatML renders the tools and the Hermes-style <tool_call> format the server parses.
        model_dir, template = resolve_model_id(args.model), "chatml"
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
    sampler = create_sampler(args.engine, model_id=str(model_dir), template=template)

    def push() -> int:
        weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()}
        return sampler.add_adapter_to_model("policy", lora, weights=weights)

    version = push()
    with sampler, start_server(sampler, log_level="error") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for step in range(args.steps):
            jobs = [(rng.randrange(11, 99), rng.randrange(11, 99)) for _ in range(args.prompts)]
            results: list[dict[str, Any]] = [{} for _ in range(args.prompts * args.group)]

            def run(k: int, a: int, b: int, out: list[dict[str, Any]] = results, step: int = step) -> None:
                out[k] = agent(client, f"step{step}-{k}", a, b, args.max_tokens)

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
            optim.zero_grad()
            total = sum(sum(1 for t in row[1:] if t != -100) for row in labels)
            gaps, kls = [], []
            # Micro-batches: the logits of a whole step (32 rollouts x ~400 tokens x a 49k vocabulary)
            # would not fit in memory at once; gradients add up to those of the whole batch.
            for lo in range(0, len(ids), args.micro_batch):
                part = slice(lo, lo + args.micro_batch)
                new_lp, mask = token_logprobs(policy, ids[part], labels[part])
                width = mask.shape[1]
                old = torch.tensor([row[1 : width + 1] + [0.0] * (width + 1 - len(row)) for row in sampler_lp[part]])
                gaps.append((new_lp.detach() - old).abs()[mask])
                ratio = torch.exp(new_lp - old)
                a = adv[part][:, None]
                obj = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
                loss = -(obj * mask).sum() / total
                if args.kl > 0:
                    # k3 estimator of KL(policy || initial model) on the sampled tokens: keeps the policy
                    # near the model it started from, whose habits (the chat format, the tool syntax of
                    # the example) every reward depends on.
                    with torch.no_grad(), policy.disable_adapter():
                        ref_lp, _ = token_logprobs(policy, ids[part], labels[part])
                    diff = (ref_lp - new_lp) * mask
                    kl_part = ((torch.exp(diff) - diff - 1) * mask).sum() / total
                    kls.append(kl_part.detach())
                    loss = loss + args.kl * kl_part
                loss.backward()
            mismatch = torch.cat(gaps)
            kl = torch.stack(kls).sum() if kls else torch.zeros(())
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(trainable, args.clip_grad)
            optim.step()
            sched.step()
            version = push()
            row = {
                "step": step,
                "tried": round(float(torch.tensor([r["tried"] for r in results]).mean()), 4),
                "called": round(float(torch.tensor([r["called"] for r in results]).mean()), 4),
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
        plot(history, args.out / "curves.png", args.model)
    first, last = history[: max(1, len(history) // 4)], history[-max(1, len(history) // 4) :]
    print(
        f"success: first {len(first)} steps {sum(r['success'] for r in first) / len(first):.3f}"
        f" -> last {len(last)} steps {sum(r['success'] for r in last) / len(last):.3f}"
    )
    return history


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Reward and success per step, and the sampler/trainer log-prob gap, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, [r["shaped"] for r in history], label="shaped reward (trained on)")
    top.plot(steps, [r["tried"] for r in history], label="first reply starts a tool call")
    top.plot(steps, [r["called"] for r in history], label="called multiply with the question's numbers")
    top.plot(steps, [r["success"] for r in history], label="success: then answered with the product")
    top.set_ylabel("mean over rollouts")
    top.legend(loc="lower right", fontsize="small")
    bottom.semilogy(steps, [max(r["mismatch_max"], 1e-9) for r in history])
    bottom.set_ylabel("max |sampler - trainer| log-prob")
    bottom.set_xlabel("step")
    fig.suptitle(f"GRPO through twinkle serve: tool-using agent, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
