"""A small GRPO trainer on twinkle: plain PyTorch + peft, no RL framework.

Each step samples ``group_size`` completions per prompt through a twinkle
sampler (any engine, local or on Ray), scores them, normalises rewards within
each group, recomputes the policy's log-probs on each sample's
``training_feature``, takes a clipped policy-gradient step, and pushes the new
weights into the sampler in memory. Every sample must carry the weights
version the trainer last pushed: a sampler running an old policy stops the run.

Trainer-side corrections (docs/rl-correctness.md): ``replay_mask`` asks the
sampler for the kept set of each position (under ``top_k`` / ``top_p`` /
``min_p``) and recomputes the trainer's log-probs over exactly that support;
``is_correction`` (``tis`` or ``mis``, at ``is_level`` token or sequence)
reweights the loss by the sampler-trainer importance ratio and logs the share
of tokens clipped or masked.

    python examples/grpo/grpo.py --config examples/grpo/tiny_torch.yaml
    python examples/grpo/grpo.py --config examples/grpo/tiny_torch.yaml --set engine=vllm --set steps=10
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tasks import make_task

from twinkle_core import SamplingParams, Trajectory, create_sampler
from twinkle_core.errors import StalePolicyError

__all__ = ["GRPOConfig", "StalePolicyError", "main", "train"]


#: Whether a LoRA policy is served merged when ``merge_lora`` is not set, per engine: measured on
#: SmolLM2, where merging made both engines' steps faster (docs/grpo.md, "Merged LoRA"). Engines
#: not listed are served unmerged.
MERGE_LORA_DEFAULT: dict[str, bool] = {"vllm": True, "torch": True}


@dataclass
class GRPOConfig:
    """Everything a run needs; every field can be set from YAML or ``--set key=value``."""

    engine: str = "torch"
    model_id: str = "tiny"  # "tiny": twinkle's tiny test model, built offline
    task: str = "digits"
    mode: str = "lora"  # "lora" or "full"
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    replay_mask: bool = False  # recompute the trainer's log-probs over the sampler's kept support
    is_correction: str = "none"  # "none", "tis" (truncated) or "mis" (masked importance sampling)
    is_level: str = "token"  # "token" or "sequence"
    is_cap: float = 2.0  # TIS: weights above it are clipped to it
    is_low: float = 0.5  # MIS: tokens (sequences) with a ratio outside [is_low, is_high] are dropped
    is_high: float = 2.0
    lr: float = 1e-2
    clip_eps: float = 0.2
    lora_rank: int = 8
    lora_alpha: int = 16
    # serve the LoRA policy merged into the base weights (add_adapter_to_model(..., merge=True));
    # None: the measured default of the engine (MERGE_LORA_DEFAULT, docs/grpo.md)
    merge_lora: bool | None = None
    seed: int = 0
    eval_prompts: int = 0  # held-out prompts scored before the first and after the last step (0: none)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    remote_group: str | None = None  # run the sampler as Ray actors in this group
    ray_cpus: int = 2
    skip_sync: bool = False  # deliberately lose the weight push (to prove the version check)
    # asynchronous mode: step k+1's rollouts are generated while step k trains; the push keeps them in
    # flight (in_flight="keep"), and the loss is corrected with truncated IS on the recorded log-probs
    async_rollout: bool = False
    max_staleness: int = 1  # async: samples may be this many versions behind the trainer's (oldest token)
    out_dir: str = "out/grpo"
    plot: bool = True
    log: bool = True

    @classmethod
    def load(cls, path: str | None, overrides: list[str]) -> GRPOConfig:
        """Read a YAML file, then apply ``key=value`` overrides (values parsed as YAML)."""
        data: dict[str, Any] = yaml.safe_load(Path(path).read_text()) if path else {}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects key=value, got {item!r}")
            data[key] = yaml.safe_load(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown config keys {unknown}; accepted: {sorted(known)}")
        return cls(**data)


def _model_dir(model_id: str) -> Path:
    if model_id == "tiny":
        from twinkle_core.testing import build_tiny_model

        return build_tiny_model("llama")
    from twinkle_core.hub import resolve_model_id

    return resolve_model_id(model_id)


def completion_logprobs(
    model: Any, features: list[Any], temperature: float, replay: tuple[list[Any], SamplingParams] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs the policy gives each completion token, under the sampling temperature.

    With ``replay`` (the sampled sequences and their params), each sequence's
    log-probs are taken over the support its sampler kept (``sampling_mask``)
    instead of the whole vocabulary.

    Returns:
        ``(logprobs, mask)``, both ``[batch, max_len - 1]``; ``mask`` marks completion tokens.
    """
    width = max(len(f.input_ids) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        n = len(f.input_ids)
        ids[i, :n] = torch.tensor(f.input_ids)
        attn[i, :n] = 1
        labels[i, :n] = torch.tensor(f.labels)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    if replay is not None:
        from twinkle_core.rl import replay_logprobs

        seqs, params = replay
        rows = []
        for i, (f, seq) in enumerate(zip(features, seqs)):
            start = len(f.input_ids) - len(seq.tokens) - 1
            lp = replay_logprobs(logits[i, start : start + len(seq.tokens)], seq.tokens, seq.sampling_mask, params)
            rows.append(torch.cat([logits.new_zeros(start), lp, logits.new_zeros(width - 1 - start - len(lp))]))
        return torch.stack(rows), mask
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_lp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return token_lp * mask, mask


def _group_advantages(rewards: list[float], group: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), group):
        chunk = torch.tensor(rewards[g : g + group])
        out += ((chunk - chunk.mean()) / (chunk.std(unbiased=False) + 1e-4)).tolist()
    return out


def train(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """Run GRPO; return one metrics dict per step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    task = make_task(cfg.task)
    model_dir = _model_dir(cfg.model_id)
    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora_config = None
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        policy = get_peft_model(policy, lora_config)
    elif cfg.mode != "full":
        raise ValueError(f"mode={cfg.mode!r}: expected 'lora' or 'full'")
    if cfg.is_correction not in ("none", "tis", "mis"):
        raise ValueError(f"is_correction={cfg.is_correction!r}: expected 'none', 'tis' or 'mis'")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optim = torch.optim.Adam(trainable, lr=cfg.lr)

    if cfg.remote_group:
        from twinkle_core import DeviceGroup, initialize

        initialize(
            "ray", groups=[DeviceGroup(name=cfg.remote_group, ranks=1, device_type="cpu")], num_cpus=cfg.ray_cpus
        )
    kwargs = dict(cfg.engine_kwargs)
    if cfg.remote_group:
        kwargs["remote_group"] = cfg.remote_group
    sampler = create_sampler(cfg.engine, model_id=str(model_dir), **kwargs)

    # async: the next step's rollouts are in flight during a push; they continue under the new weights
    in_flight = "keep" if cfg.async_rollout else "wait"
    if cfg.merge_lora is not None:
        merge = cfg.merge_lora
    else:  # the engine's measured default, for a LoRA policy (a full fine-tune has nothing to merge)
        merge = lora_config is not None and MERGE_LORA_DEFAULT.get(cfg.engine, False)
    if merge and lora_config is None:
        raise ValueError(f"merge_lora={cfg.merge_lora!r} needs mode='lora' (mode={cfg.mode!r})")

    def push() -> tuple[int, float]:
        t = time.perf_counter()
        if lora_config is not None:
            from peft import get_peft_model_state_dict

            weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()}
            options = {"merge": True} if merge else {}  # only engines that merge know the option
            version = sampler.add_adapter_to_model(
                "policy", lora_config, weights=weights, in_flight=in_flight, **options
            )
        else:
            named = [(k, v.detach().clone()) for k, v in policy.state_dict().items()]
            version = sampler.update_weights(named, in_flight=in_flight)
        return version, time.perf_counter() - t

    adapter = "policy" if lora_config is not None else ""
    expected_version, _ = push()
    # a held-out set, drawn from its own random stream so it never meets a training prompt's draw
    held_out = task.batch(random.Random(cfg.seed + 1_000_003), cfg.eval_prompts)

    def evaluate() -> float:
        """Mean reward of ``group_size`` samples per held-out prompt, with a fixed seed."""
        params = SamplingParams(
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, num_samples=cfg.group_size, seed=cfg.seed
        )
        responses = sampler.sample([Trajectory(messages=m) for m, _ in held_out], params, adapter_name=adapter)
        scores = [task.reward(s.text, info) for (_, info), r in zip(held_out, responses) for s in r.sequences]
        return sum(scores) / len(scores)

    summary: dict[str, Any] = {}
    if held_out:
        summary["eval_before"] = evaluate()
        if cfg.log:
            print(
                f"held-out reward before training: {summary['eval_before']:.3f} ({len(held_out)} prompts)", flush=True
            )
    history: list[dict[str, Any]] = []
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:

        def rollout() -> tuple[list[Any], SamplingParams, Any]:
            """Draw a step's prompts and submit their sampling; returns the batch, params and handle."""
            batch = task.batch(rng, cfg.prompts_per_step)
            params = SamplingParams(
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                min_p=cfg.min_p,
                logprobs=0,
                num_samples=cfg.group_size,
                seed=rng.randrange(2**31),
                return_sampling_mask=cfg.replay_mask,
            )
            handle = sampler.submit([Trajectory(messages=m) for m, _ in batch], params, adapter_name=adapter)
            return batch, params, handle

        # async: how far a sample's oldest token may lag the trainer's version, and the correction it needs
        staleness = cfg.max_staleness if cfg.async_rollout else 0
        correction = "tis" if cfg.async_rollout and cfg.is_correction == "none" else cfg.is_correction
        pending = rollout()
        for step in range(cfg.steps):
            t_step = time.perf_counter()
            batch, params, handle = pending
            t0 = time.perf_counter()
            responses = handle.result()
            t_sample = time.perf_counter() - t0  # async: only the wait left after the previous step
            if cfg.async_rollout and step + 1 < cfg.steps:
                pending = rollout()  # generated while this step trains; the push below keeps it in flight
            seqs, rewards = [], []
            lag = 0
            for (_, info), resp in zip(batch, responses):
                for seq in resp.sequences:
                    behind = expected_version - seq.weights_version
                    if not 0 <= behind <= staleness:
                        raise StalePolicyError(
                            f"step {step}: a sample carries weights_version {seq.weights_version} but the trainer"
                            f" pushed version {expected_version}"
                            + (f" (allowed lag: {staleness})" if staleness else "")
                            + ": the sampler is not running the current policy."
                        )
                    lag = max(lag, behind)
                    seqs.append(seq)
                    rewards.append(task.reward(seq.text, info))
            n_tokens = sum(len(s.tokens) for s in seqs)
            adv = torch.tensor(_group_advantages(rewards, cfg.group_size))

            t1 = time.perf_counter()
            features = [s.training_feature for s in seqs]
            sampler_lp = torch.zeros(len(seqs), max(len(f.input_ids) for f in features) - 1)
            for i, s in enumerate(seqs):
                start = len(s.training_feature.input_ids) - len(s.tokens) - 1
                sampler_lp[i, start : start + len(s.tokens)] = torch.tensor(s.logprobs)
            policy.train()
            replay = (seqs, params) if cfg.replay_mask else None
            new_lp, mask = completion_logprobs(policy, features, cfg.temperature, replay)
            old_lp = new_lp.detach()
            diff = (old_lp - sampler_lp).abs()[mask]
            is_ratio = torch.exp(old_lp - sampler_lp)[mask]
            ratio = torch.exp(new_lp - old_lp)
            a = adv.unsqueeze(1)
            objective = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a)
            is_share = 0.0
            if correction != "none":
                from twinkle_core.rl import masked_is, truncated_is

                level: Any = cfg.is_level
                if correction == "tis":
                    corr = truncated_is(old_lp, sampler_lp, mask, cap=cfg.is_cap, level=level)
                else:
                    corr = masked_is(old_lp, sampler_lp, mask, low=cfg.is_low, high=cfg.is_high, level=level)
                objective = objective * corr.weights  # constants: they reweight, not redirect, the gradient
                is_share = corr.share
            loss = -(objective * mask).sum() / mask.sum()
            optim.zero_grad()
            loss.backward()
            optim.step()
            t_train = time.perf_counter() - t1

            if cfg.skip_sync:
                expected_version += 1  # the trainer believes it pushed; the sampler never got it
                t_sync = 0.0
            else:
                expected_version, t_sync = push()
            if not cfg.async_rollout and step + 1 < cfg.steps:
                pending = rollout()
            row = {
                "step": step,
                "reward": sum(rewards) / len(rewards),
                "loss": float(loss.detach()),
                "mismatch_mean": float(diff.mean()),
                "mismatch_max": float(diff.max()),
                "is_ratio_mean": float(is_ratio.mean()),
                "is_ratio_min": float(is_ratio.min()),
                "is_ratio_max": float(is_ratio.max()),
                "is_share": is_share,  # tokens clipped (tis) or masked (mis) by the correction
                "sample_s": t_sample,
                "train_s": t_train,
                "sync_s": t_sync,
                "sample_tokens_per_s": n_tokens / t_sample if t_sample > 0 else math.inf,
                "step_s": time.perf_counter() - t_step,
                "staleness_max": lag,  # versions the oldest sampled token lagged the trainer
                "weights_version": expected_version,
                "merged_lora": merge,
            }
            history.append(row)
            if cfg.log:
                print(
                    f"step {step:3d}  reward {row['reward']:.3f}  mismatch mean {row['mismatch_mean']:.2e}"
                    f" max {row['mismatch_max']:.2e}  ratio [{row['is_ratio_min']:.4f}, {row['is_ratio_max']:.4f}]"
                    f"  sample {t_sample:.2f}s ({row['sample_tokens_per_s']:.0f} tok/s)  train {t_train:.2f}s"
                    f"  sync {t_sync * 1000:.0f}ms"
                    + (f"  {correction} share {is_share:.3f}" if correction != "none" else "")
                    + (f"  lag {lag}" if cfg.async_rollout else ""),
                    flush=True,
                )
        if held_out:
            summary["eval_after"] = evaluate()
            if cfg.log:
                print(f"held-out reward after training: {summary['eval_after']:.3f}", flush=True)
    finally:
        sampler.close()
        if cfg.remote_group:
            from twinkle_core import shutdown

            shutdown()  # the Ray runtime this run started
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
        (out_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        if summary:
            (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
        if cfg.plot and history:
            plot(history, out_dir / "curves.png", title=f"GRPO {cfg.task} on {cfg.model_id} ({cfg.engine}, {cfg.mode})")
    return history


def plot(history: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Reward and sampler-vs-trainer log-prob mismatch per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    rewards = [r["reward"] for r in history]
    ax1.plot(steps, rewards, marker="o", alpha=0.5, label="per step")
    window = 5
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax1.plot(steps[window - 1 :], smooth, label=f"mean of last {window}")
        ax1.legend()
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward")
    ax1.set_title("reward")
    ax2.semilogy(steps, [max(r["mismatch_mean"], 1e-12) for r in history], label="mean |Δ logprob|")
    ax2.semilogy(steps, [max(r["mismatch_max"], 1e-12) for r in history], label="max |Δ logprob|")
    ax2.set_xlabel("step")
    ax2.set_title("sampler vs trainer log-probs")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    cfg = GRPOConfig.load(args.config, args.set)
    history = train(cfg)
    first = sum(r["reward"] for r in history[:3]) / min(3, len(history))
    last = sum(r["reward"] for r in history[-3:]) / min(3, len(history))
    print(f"reward: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; metrics in {cfg.out_dir}")


if __name__ == "__main__":
    main()
