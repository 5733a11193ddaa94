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
    AdapterError,
    ConfigError,
    DuplicateSamplerError,
    EngineDeadError,
    HubUnavailableError,
    IncompleteUpdateError,
    InvalidInputError,
    InvalidMeshError,
    InvalidModelIdError,
    InvalidSamplingParams,
    MergedAdapterError,
    ModelNotFoundError,
    NumericalError,
    PluginLoadError,
    PolicyMismatchError,
    PromptTooLongError,
    SamplerClosedError,
    StalePolicyError,
    TemplateError,
    TwinkleError,
    UnknownAdapterError,
    UnknownSamplerError,
    UnknownTemplateError,
    UnsupportedFeatureError,
    WeightSyncTimeoutError,
    WeightUpdateError,
)
from twinkle_core.factory import NamedSampler, create_sampler, get_sampler_class, list_samplers, register_sampler
from twinkle_core.hub import resolve_model_id
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote import initialize, remote_class, shutdown
from twinkle_core.sampler import AdapterInfo, Sampler
from twinkle_core.server import serve
from twinkle_core.template import Template, register_template

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "ConfigError",
    "DeviceGroup",
    "DeviceMesh",
    "DuplicateSamplerError",
    "EngineDeadError",
    "HubUnavailableError",
    "IncompleteUpdateError",
    "InputFeature",
    "InvalidInputError",
    "InvalidMeshError",
    "InvalidModelIdError",
    "InvalidSamplingParams",
    "MergedAdapterError",
    "Message",
    "ModelNotFoundError",
    "NamedSampler",
    "NumericalError",
    "PluginLoadError",
    "PolicyMismatchError",
    "PromptTooLongError",
    "SampleResponse",
    "SampledSequence",
    "Sampler",
    "SamplerClosedError",
    "SamplingParams",
    "StalePolicyError",
    "Template",
    "TemplateError",
    "Tool",
    "Trajectory",
    "TwinkleError",
    "UnknownAdapterError",
    "UnknownSamplerError",
    "UnknownTemplateError",
    "UnsupportedFeatureError",
    "WeightSyncTimeoutError",
    "WeightUpdateError",
    "__version__",
    "create_sampler",
    "get_sampler_class",
    "initialize",
    "list_samplers",
    "register_sampler",
    "register_template",
    "remote_class",
    "resolve_model_id",
    "serve",
    "shutdown",
]
