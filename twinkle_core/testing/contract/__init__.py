"""``SamplerContractTests``: the behaviour every engine must show, as pytest tests.

Subclass it in an engine's test module and provide a ``sampler`` fixture
(module- or class-scoped: building an engine is slow)::

    class TestMyEngine(SamplerContractTests):
        @pytest.fixture(scope="class")
        @classmethod
        def sampler(cls):
            with MySampler(build_tiny_model()) as s:
                yield s

The tests are model-agnostic: they derive every expectation from the
engine's own outputs (greedy text, its tokens) rather than hard-coding one.
They assume a chat template, a vocabulary of a few hundred tokens or more,
and a model whose greedy continuations run for at least a dozen tokens.

The numbers are checked too: for each sampling field alone and all of them
together, an engine's processed log-probs (the sampled token's and the top-k
alternatives') must match :mod:`twinkle_core.testing.reference` computed from
the same engine's raw log-probs, and each field must change what is sampled.
That asks of the engine that it returns log-prob alternatives for up to
``vocab_size`` tokens (``logprobs`` and ``prompt_logprobs`` up to the whole
vocabulary: vLLM needs ``max_logprobs`` at least the vocabulary size) and that
prompt log-probs asked with ``logprobs_mode="raw"`` are the raw log-softmax.
Fields an engine does not declare in ``supported_params`` must be refused
with ``UnsupportedFeatureError`` instead.

The suite is one class composed of parts, each in a module named for what it
probes: :mod:`.output` (the shape of the responses), :mod:`.stopping`,
:mod:`.determinism`, :mod:`.logprobs`, :mod:`.sampling_fields` (the numbers
against the reference, field by field), :mod:`.errors` (bad input),
:mod:`.masks`, :mod:`.options` (constraints, bias, text and prompt options),
:mod:`.structured` and :mod:`.media` (images: sampled from, or refused by name;
a vision-language engine's module runs its image cases through
:class:`MediaContractTests` alone); :mod:`.base` holds the tolerances, the ``sampler`` fixture
and the helpers they share, :mod:`.prompts` the inputs.
"""

from __future__ import annotations

from twinkle_core.testing.contract.determinism import DeterminismTests
from twinkle_core.testing.contract.errors import BadInputTests
from twinkle_core.testing.contract.logprobs import LogprobTests
from twinkle_core.testing.contract.masks import SamplingMaskTests
from twinkle_core.testing.contract.media import MediaContractTests
from twinkle_core.testing.contract.options import SamplingOptionTests
from twinkle_core.testing.contract.output import OutputShapeTests
from twinkle_core.testing.contract.prompts import CONTRACT_PROMPTS
from twinkle_core.testing.contract.sampling_fields import SamplingFieldTests
from twinkle_core.testing.contract.stopping import StoppingTests
from twinkle_core.testing.contract.structured import StructuredOutputTests

__all__ = ["CONTRACT_PROMPTS", "MediaContractTests", "SamplerContractTests"]


# pytest runs inherited tests base by base, from the last base to the first: listed in reverse,
# the parts run in reading order (output shape first, structured outputs last).
class SamplerContractTests(
    MediaContractTests,
    StructuredOutputTests,
    SamplingOptionTests,
    SamplingMaskTests,
    BadInputTests,
    SamplingFieldTests,
    LogprobTests,
    DeterminismTests,
    StoppingTests,
    OutputShapeTests,
):
    """The engine-independent contract. Subclasses provide the ``sampler`` fixture."""
