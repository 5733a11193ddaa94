"""A training script that uses the torch engine exits with its own status, never an abort.

The decode loop runs in a daemon thread. A process that reached interpreter
exit while that thread was inside a native call (a forward, or freeing the
KV cache after the last run returned) used to abort in teardown with
``terminate called without an active exception`` (status 134), turning a
finished job into a failed one. Each case runs a real script in a fresh
interpreter and checks its exit status and its stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from twinkle_core import SamplingParams, Trajectory
    from twinkle_core.testing import TINY_CHAT_PROMPTS
    from twinkle_torch import TorchSampler

    if __name__ == "__main__":
        model, case = sys.argv[1], sys.argv[2]
        sampler = TorchSampler(model, device="cpu")
        prompts = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS]
        if case in ("finished", "finished-no-close"):
            # the benchmark's shape, scaled to the tiny model: many rows, all finished before exit
            out = sampler.sample(prompts * 8, SamplingParams(max_tokens=128, temperature=1.0, top_p=0.95,
                                                             ignore_eos=True, num_samples=4))
            assert sum(len(s.tokens) for r in out for s in r.sequences) == len(prompts) * 8 * 4 * 128
            if case == "finished":
                sampler.close()
            print("done", flush=True)
            sys.exit(0)
        if case == "failed-run":
            # a run that fails inside the engine (its forward raises), then the script goes on and ends
            hook = sampler.model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
            try:
                sampler.sample(prompts, SamplingParams(max_tokens=8))
            except RuntimeError as exc:
                assert "boom" in str(exc)
            hook.remove()
            assert len(sampler.sample(prompts, SamplingParams(max_tokens=8))) == len(prompts)
            print("done", flush=True)
            sys.exit(0)
        # a long run still decoding when the script leaves, with or without an exception
        handle = sampler.submit(prompts, SamplingParams(max_tokens=400, ignore_eos=True, num_samples=16))
        sampler.sample(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # joins the running batch
        assert not handle.done()
        if case == "in-flight-raise":
            raise RuntimeError("the training script failed")
        print("done", flush=True)
    """
)

#: case -> the exit status the script itself asks for
CASES = {
    "finished": 0,
    "finished-no-close": 0,
    "failed-run": 0,
    "in-flight-exit": 0,
    "in-flight-raise": 1,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_process_exits_with_its_own_status(case: str, tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_llama), case], capture_output=True, text=True, timeout=600
    )
    assert "terminate called" not in proc.stderr
    assert proc.returncode == CASES[case], proc.stderr[-2000:]
    if CASES[case] == 0:
        assert proc.stdout.strip().endswith("done")
    else:
        assert "the training script failed" in proc.stderr
