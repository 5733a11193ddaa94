"""The reference documentation's sampler examples, run verbatim through the ``twinkle`` alias.

Each snippet below is quoted from the reference project's docs (ModelScope
twinkle, ``docs/source_en/Components/Sampler/``); the test changes only what
this machine forces, each change listed next to the snippet and applied by
:func:`adapt`, which fails if the quoted text no longer holds the line it
replaces:

* the model id, to the core's tiny offline model (and, with it, the vLLM
  example's ``set_template('Qwen3_5Template')``: the tiny model speaks
  ChatML, which the core registers as ``'chatml'``);
* the device type, to ``cpu``, and the Ray example's 4 devices to the 2 this
  machine has;
``'path/to/lora'`` itself stays verbatim: each snippet runs in a fresh folder
where a real PEFT LoRA adapter for the tiny model is saved under that path.

Every snippet runs in its own interpreter: they call ``twinkle.initialize``
and start engines (and, for Ray, a local cluster) that must not leak into
other tests; vLLM's engine process is spawned, which a ``python -c`` main
module allows without an ``if __name__ == '__main__'`` guard. After the
snippet, a short epilogue writes what a user would look at to
``result.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from twinkle_core.testing import build_tiny_model  # noqa: E402

# -- the reference snippets, verbatim ---------------------------------------------------------------

#: docs/source_en/Components/Sampler/vLLMSampler.md, "Usage Example" (modelscope/twinkle @32fe620).
VLLM_LORA_SNIPPET = """\
import twinkle
from twinkle.sampler import vLLMSampler
from twinkle.data_format import SamplingParams, Trajectory
from twinkle import DeviceMesh

twinkle.initialize(mode='local', nproc_per_node=1)
trajectories = [Trajectory(messages=[{'role': 'user', 'content': 'What is 2 + 3?'}])]

# Create sampler
sampler = vLLMSampler(
    model_id='ms://Qwen/Qwen3.5-4B',
    engine_args={'enable_lora': True, 'max_lora_rank': 16},
    device_mesh=DeviceMesh.from_sizes(dp_size=1),
)

# Encode chat messages using the model's template
sampler.set_template('Qwen3_5Template')

# Set sampling parameters
params = SamplingParams(
    max_tokens=512,
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    num_samples=4,
)

# Perform sampling
responses = sampler.sample(
    trajectories,
    sampling_params=params,
    adapter_path='path/to/lora',  # Saved LoRA checkpoint (rank <= max_lora_rank)
)
"""

#: The same page, "Remote Execution" (identical in both revisions but for the model id).
#: It uses the first example's ``trajectories`` and ``params``: :data:`PAGE_PRELUDE` holds those lines.
VLLM_RAY_SNIPPET = """\
import twinkle
from twinkle import DeviceGroup, DeviceMesh
from twinkle.sampler import vLLMSampler

# Initialize Ray cluster
device_groups = [
    DeviceGroup(name='sampler', ranks=4, device_type='cuda')
]
twinkle.initialize('ray', groups=device_groups)

# Create remote sampler
sampler = vLLMSampler(
    model_id='ms://Qwen/Qwen3.5-4B',
    device_mesh=DeviceMesh.from_sizes(dp_size=4),
    remote_group='sampler'
)

# sample method executes in remote worker
responses = sampler.sample(trajectories, sampling_params=params)
"""

#: docs/source_en/Components/Sampler/TorchSampler.md, "Usage Example" (the revision that still had
#: TorchSampler: tastelikefeet/twinkle, the reference's earlier tree). It also uses ``trajectories`` and ``params``.
TORCH_SNIPPET = """\
from twinkle.sampler import TorchSampler
from twinkle import DeviceMesh

sampler = TorchSampler(
    model_id='ms://Qwen/Qwen2.5-7B-Instruct',
    device_mesh=DeviceMesh.from_sizes(dp_size=1),
)

response = sampler.sample(trajectories, sampling_params=params)
"""

#: The lines of the vLLM page's first example that the later examples rely on, verbatim.
PAGE_PRELUDE = """\
from twinkle.data_format import SamplingParams, Trajectory
trajectories = [Trajectory(messages=[{'role': 'user', 'content': 'What is 2 + 3?'}])]
params = SamplingParams(
    max_tokens=512,
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    num_samples=4,
)
"""

#: What every epilogue reports about a list of responses.
REPORT = """
import json, os
def _seqs(rs):
    return [[{'text': q.text, 'tokens': len(q.tokens), 'adapter': q.adapter_name, 'version': q.weights_version,
              'stop': q.stop_reason} for q in r.sequences] for r in rs]
"""


def adapt(snippet: str, changes: list[tuple[str, str]]) -> str:
    """Apply this machine's changes to a quoted snippet; each old text must occur exactly once."""
    for old, new in changes:
        assert snippet.count(old) == 1, f"the quoted snippet no longer holds {old!r} exactly once"
        snippet = snippet.replace(old, new)
    return snippet


# -- running them -----------------------------------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_lora(model_dir: Path, out_dir: Path, rank: int = 8) -> Path:
    """Save a PEFT LoRA adapter for ``model_dir`` that visibly changes its outputs.

    PEFT starts ``lora_B`` at zero, which would make the adapter a no-op and a
    missing adapter undetectable; random ``lora_B`` makes it matter.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def workdir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``path/to/lora``, the adapter the snippets name, for the tiny model."""
    root = tmp_path_factory.mktemp("reference")
    save_lora(tiny_model, root / "path" / "to" / "lora")
    return root


def run_snippet(code: str, cwd: Path) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter in ``cwd``; return the ``result.json`` its epilogue wrote."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    result = cwd / "result.json"
    result.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"the snippet failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(result.read_text())


def check_samples(seqs: list[list[dict[str, Any]]], n_inputs: int, n_samples: int, adapter: str = "") -> None:
    """What a user checks first: one response per input, ``n_samples`` non-empty completions each."""
    assert len(seqs) == n_inputs
    for per_input in seqs:
        assert len(per_input) == n_samples
        for seq in per_input:
            assert seq["tokens"] > 0 and seq["text"].strip()
            assert seq["adapter"] == adapter
            assert seq["stop"] in ("stop", "length")


# -- the tests --------------------------------------------------------------------------------------


def test_vllm_example_with_lora_and_four_samples(tiny_model: Path, workdir: Path):
    pytest.importorskip("twinkle_vllm")
    code = adapt(
        VLLM_LORA_SNIPPET,
        [
            ("'ms://Qwen/Qwen3.5-4B'", repr(str(tiny_model))),
            ("sampler.set_template('Qwen3_5Template')", "sampler.set_template('chatml')"),
        ],
    )
    # The adapter must really be in use: greedy completions with and without it differ.
    epilogue = (
        REPORT
        + """
greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
with_lora = sampler.sample(trajectories, sampling_params=greedy, adapter_path='path/to/lora')[0].sequences[0].tokens
base = sampler.sample(trajectories, sampling_params=greedy)[0].sequences[0].tokens
json.dump({'seqs': _seqs(responses), 'adapters': sorted(sampler.adapters), 'lora_changes_output': with_lora != base,
           'engine': type(sampler).__module__}, open('result.json', 'w'))
sampler.close()
"""
    )
    out = run_snippet(code + epilogue, workdir)
    assert out["engine"].startswith("twinkle_vllm")
    # adapter_path loads the folder once, under a name that says where it came from
    assert out["adapters"] == [f"path:{(workdir / 'path/to/lora').resolve()}"]
    check_samples(out["seqs"], n_inputs=1, n_samples=4, adapter=out["adapters"][0])
    # adding the adapter bumped the weights version; every sample says which weights made it
    assert {seq["version"] for seq in out["seqs"][0]} == {1}
    assert out["lora_changes_output"]


def test_vllm_ray_example_on_two_cpu_replicas(tiny_model: Path, workdir: Path):
    pytest.importorskip("ray")
    pytest.importorskip("twinkle_vllm")
    code = PAGE_PRELUDE + adapt(
        VLLM_RAY_SNIPPET,
        [
            ("'ms://Qwen/Qwen3.5-4B'", repr(str(tiny_model))),
            ("ranks=4, device_type='cuda'", "ranks=2, device_type='cpu'"),
            ("dp_size=4", "dp_size=2"),
        ],
    )
    epilogue = (
        REPORT
        + """
replicas = sampler.replicas
json.dump({'seqs': _seqs(responses), 'num_replicas': sampler.num_replicas, 'pids': [r.pid for r in replicas],
           'driver_pid': os.getpid(), 'front_end': type(sampler).__name__}, open('result.json', 'w'))
sampler.close()
twinkle.shutdown()
"""
    )
    out = run_snippet(code + epilogue, workdir)
    assert out["front_end"] == "RemoteSampler"
    assert out["num_replicas"] == 2
    # two engines in two Ray worker processes, neither of them the driver
    assert len(set(out["pids"])) == 2 and out["driver_pid"] not in out["pids"]
    check_samples(out["seqs"], n_inputs=1, n_samples=4)


def test_torch_example(tiny_model: Path, workdir: Path):
    pytest.importorskip("twinkle_torch")
    code = PAGE_PRELUDE + adapt(TORCH_SNIPPET, [("'ms://Qwen/Qwen2.5-7B-Instruct'", repr(str(tiny_model)))])
    epilogue = (
        REPORT
        + """
json.dump({'seqs': _seqs(response), 'engine': type(sampler).__module__}, open('result.json', 'w'))
sampler.close()
"""
    )
    out = run_snippet(code + epilogue, workdir)
    assert out["engine"].startswith("twinkle_torch")
    check_samples(out["seqs"], n_inputs=1, n_samples=4)


def test_adapter_path_loads_once_and_again_when_the_folder_changes(tiny_model: Path, tmp_path: Path):
    pytest.importorskip("twinkle_torch")
    import shutil

    from twinkle.data_format import SamplingParams, Trajectory
    from twinkle.sampler import TorchSampler

    folder = tmp_path / "path/to/lora"
    save_lora(tiny_model, folder)
    prompt = [Trajectory(messages=[{"role": "user", "content": "What is 2 + 3?"}])]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with TorchSampler(model_id=str(tiny_model)) as sampler:
        first = sampler.sample(prompt, sampling_params=greedy, adapter_path=str(folder))[0].sequences[0]
        name = f"path:{folder.resolve()}"
        assert first.adapter_name == name and list(sampler.adapters) == [name]
        version = sampler.weights_version
        again = sampler.sample(prompt, sampling_params=greedy, adapter_path=folder)[0].sequences[0]
        assert again.tokens == first.tokens and sampler.weights_version == version  # not loaded twice
        # a trainer saves a new checkpoint to the same folder: the next call serves it
        other = tmp_path / "other"
        save_lora(tiny_model, other, rank=4)  # another adapter: another size on disk
        for f in other.iterdir():
            shutil.copy(f, folder / f.name)
        changed = sampler.sample(prompt, sampling_params=greedy, adapter_path=folder)[0].sequences[0]
        assert sampler.weights_version == version + 1 and changed.weights_version == version + 1
        with pytest.raises(Exception, match="give one of them"):
            sampler.sample(prompt, sampling_params=greedy, adapter_name=name, adapter_path=folder)
