"""twinkle: sampling from language models for RL post-training.

``import twinkle_core`` is cheap: it scans no plugins and imports no torch,
transformers, vllm or ray. Engines are found on first use.
"""

from twinkle_core._version import __version__
from twinkle_core.data_format import (
    InputFeature,
    Message,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Tool,
    Trajectory,
)
from twinkle_core.errors import (
    InvalidInputError,
    InvalidSamplingParams,
    TwinkleError,
    UnknownAdapterError,
    UnknownSamplerError,
    UnknownTemplateError,
)
from twinkle_core.factory import create_sampler, get_sampler_class, list_samplers, register_sampler
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote import initialize, remote_class, shutdown
from twinkle_core.sampler import AdapterInfo, Sampler
from twinkle_core.template import Template, register_template

__all__ = [
    "AdapterInfo",
    "DeviceGroup",
    "DeviceMesh",
    "InputFeature",
    "InvalidInputError",
    "InvalidSamplingParams",
    "Message",
    "SampleResponse",
    "SampledSequence",
    "Sampler",
    "SamplingParams",
    "Template",
    "Tool",
    "Trajectory",
    "TwinkleError",
    "UnknownAdapterError",
    "UnknownSamplerError",
    "UnknownTemplateError",
    "__version__",
    "create_sampler",
    "get_sampler_class",
    "initialize",
    "list_samplers",
    "register_sampler",
    "register_template",
    "remote_class",
    "shutdown",
]
