"""Every hybrid (stateful) family of ``transformers``: does twinkle's vLLM engine sample it on the CPU build?

For each family it builds the tiny random model the torch engine's families
sweep builds (``twinkle_core.testing.tiny_families``), with the head sizes
vLLM's CPU kernels take where the sweep's differ (``VLLM_SIZES``: attention
heads of 32, 64, 80, 96, 112, 128, 160, 192, 224 or 256; Gated DeltaNet
key and value heads equal, of 64 or 128), saves it, and in a subprocess of
its own with a time limit:

- tries the torch engine in bfloat16: greedy tokens, or its refusal;
- tries twinkle's vLLM engine (bfloat16, ``enforce_eager``, a small KV
  cache): greedy tokens, or the first line of the error (and the line of
  vLLM's log that names the cause, when the engine's subprocess died).

Where both sample, it reports how many greedy tokens agree (each sequence
compared up to its first difference: random weights in bfloat16 have near
ties, so a late divergence is rounding, an early one on every prompt is not).
It is a probe to run by hand, not a test:

    python bench/probe_vllm_families.py [--families qwen3_5 mamba] [--timeout 420] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The hybrid families of transformers 5.19 (docs/hybrid-models.md), each with the state it keeps.
HYBRIDS: dict[str, str] = {
    "qwen3_5": "Gated DeltaNet",
    "qwen3_5_text": "Gated DeltaNet",
    "qwen3_5_moe": "Gated DeltaNet",
    "qwen3_5_moe_text": "Gated DeltaNet",
    "qwen3_next": "Gated DeltaNet",
    "olmo_hybrid": "Gated DeltaNet",
    "lfm2": "short convolution",
    "lfm2_moe": "short convolution",
    "granitemoehybrid": "Mamba-2",
    "bamba": "Mamba-2",
    "falcon_h1": "Mamba-2 and keys/values in one layer",
    "zamba2": "Mamba-2 and keys/values in one layer",
    "jamba": "Mamba",
    "mamba": "Mamba",
    "mamba2": "Mamba-2",
    "falcon_mamba": "Mamba",
    "nemotron_h": "Mamba-2",
    "zamba": "Mamba",
    "zaya": "Mamba-2-like",
    "kimi_linear": "Kimi delta attention",
    "qwen4_exp": "Gated DeltaNet with n-gram / PLE states",
    "qwen4_exp_text": "Gated DeltaNet with n-gram / PLE states",
    "recurrent_gemma": "RG-LRU",
    "rwkv": "RWKV time mixing",
    "xlstm": "mLSTM",
    "deepseek_v4": "compressed-attention state",
    "inkling_text": "hybrid layers with a recurrent cache",
    "minimax": "lightning attention",
}

#: Fields over the sweep's tiny config so that a failure is vLLM's support, not the config's: vLLM's CPU
#: attention takes head sizes of 32 to 256 in steps of 16 or 32 (its list), its Gated DeltaNet kernels
#: key and value heads of equal size, 64 or 128.
GDN_HEADS = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2)
VLLM_SIZES: dict[str, dict[str, Any]] = {
    **{
        name: dict(head_dim=64, **GDN_HEADS)
        for name in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid")
    },
    "qwen4_exp_text": dict(linear_key_head_dim=64, linear_value_head_dim=64),
}

PROMPTS = [[{"role": "user", "content": "hi " * k + "there"}] for k in (1, 9, 4)]
MAX_TOKENS = 12

_CAUSE = re.compile(r"\b([A-Z]\w*(Error|Exception)|AssertionError|NotImplementedError)\b:?\s*(.*)")
#: pydantic's report of a VllmConfig field vLLM refused.
_VALUE_ERROR = re.compile(r"Value error, (.*?)\s*(\[type=|$)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _greedy(sampler: Any) -> list[list[int]]:
    from twinkle_core.data_format import SamplingParams, Trajectory

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = sampler.sample([Trajectory(messages=m) for m in PROMPTS], params)
    return [list(r.sequences[0].tokens) for r in out]


def one(model_type: str, root: Path) -> dict[str, Any]:
    """Build ``model_type`` in ``root`` and try both engines on it (runs in the child process)."""
    from twinkle_core.testing.tiny_families import family_config, language_model
    from twinkle_core.testing.tiny_random import save_random_model

    result: dict[str, Any] = {"family": model_type}
    try:
        config, model = language_model(family_config(model_type, VLLM_SIZES))
        result["architecture"] = type(model).__name__
        save_random_model(config, root)
        if config.get_text_config() is not config:  # a composite: its config, naming the class its weights are of
            config.architectures = [result["architecture"]]
            config.save_pretrained(root)
    except Exception as exc:
        result["build"] = _first_line(exc)
        return result
    try:
        from twinkle_torch import TorchSampler

        with TorchSampler(root, device="cpu", dtype="bfloat16") as sampler:
            result["torch"] = _greedy(sampler)
    except Exception as exc:
        result["torch_error"] = _first_line(exc)
    print(json.dumps(result), flush=True)  # what is known, should vLLM kill this process
    try:
        from twinkle_vllm.sampler import vLLMSampler

        options = dict(enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=1 << 28, max_num_seqs=8)
        with vLLMSampler(root, engine_args=options) as sampler:
            result["vllm"] = _greedy(sampler)
    except Exception as exc:
        result["vllm_error"] = _first_line(exc)
        refused = _VALUE_ERROR.search(str(exc))  # a VllmConfig field refused: pydantic says which, past line one
        if refused:
            result["vllm_detail"] = f"VllmConfig: {refused.group(1)}"[:300]
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How many greedy tokens agree, each sequence up to its first difference."""
    same = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same += n
    total = sum(len(x) for x in a)
    return f"{same}/{total} greedy tokens agree"


def _cause(log: str) -> str:
    """The last line of a child's log that names an exception (vLLM's engine process reports its cause so)."""
    found = ""
    lines = [line for line in log.splitlines() if not line.startswith("{")]  # not the child's own results
    refused = [m.group(1) for line in lines if (m := _VALUE_ERROR.search(line))]
    if refused:
        return f"VllmConfig: {refused[-1]}"[:300]
    for line in lines:
        match = _CAUSE.search(line)
        if match and "Engine core initialization failed" not in line and "Traceback" not in line:
            found = f"{match.group(1)}: {match.group(3)}".strip()[:300]
    return found


def probe(model_type: str, timeout: float) -> dict[str, Any]:
    """One family in a subprocess of its own: its result, or what killed it."""
    with tempfile.TemporaryDirectory(prefix=f"probe-{model_type}-") as tmp:
        cmd = [sys.executable, __file__, "--one", model_type, "--out", tmp]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
            stdout, log = proc.stdout, proc.stderr + proc.stdout
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            log = stdout + (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
            proc = None
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        result: dict[str, Any] = json.loads(lines[-1]) if lines else {"family": model_type}
        result["seconds"] = round(time.monotonic() - start)
        if proc is None:
            result.setdefault("vllm_error", f"no answer in {timeout:.0f} s")
        elif "vllm" not in result and "vllm_error" not in result and "build" not in result:
            result["vllm_error"] = f"the process died (exit {proc.returncode})"
        if "vllm_error" in result:
            result["vllm_cause"] = result.get("vllm_detail") or _cause(log)
        return result


def row(result: dict[str, Any]) -> str:
    family = result["family"]
    if "build" in result:
        return f"| `{family}` | {HYBRIDS.get(family, '')} | not built: {result['build']} | not built |"
    torch = "samples (bfloat16)" if "torch" in result else f"refused: {result.get('torch_error', '?')}"
    if "vllm" in result:
        vllm = "samples"
        if "torch" in result:
            vllm += f"; {agreement(result['vllm'], result['torch'])} with the torch engine"
    else:
        vllm = f"fails: {result.get('vllm_error', '?')}"
        if result.get("vllm_cause") and result["vllm_cause"] not in vllm:
            vllm += f" (cause: {result['vllm_cause']})"
    clean = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return f"| `{family}` | {HYBRIDS.get(family, '')} | {clean(torch)} | {clean(vllm)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(HYBRIDS))
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per family")
    parser.add_argument("--json", type=Path, default=None, help="also write every result here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.one:
        print(json.dumps(one(args.one, args.out)), flush=True)
        return
    results = []
    print("| family | its state | torch engine (bfloat16) | vLLM engine (CPU build, bfloat16) |")
    print("|---|---|---|---|", flush=True)
    for family in args.families:
        results.append(probe(family, args.timeout))
        print(row(results[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
