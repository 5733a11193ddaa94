"""The data formats: attrs classes, validated, round-tripping through dicts."""

from twinkle_core.data_format.chat import ROLES, Message, Tool, Trajectory
from twinkle_core.data_format.feature import IGNORE_INDEX, InputFeature, training_feature
from twinkle_core.data_format.output import SampledSequence, SampleResponse, SamplingMask, StopReason, TopLogprobs
from twinkle_core.data_format.params import LogprobsMode, SamplingParams, bad_word_token_ids, check_constraints
from twinkle_core.data_format.structured import StructuredOutputs

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "InputFeature",
    "LogprobsMode",
    "Message",
    "SampleResponse",
    "SampledSequence",
    "SamplingMask",
    "SamplingParams",
    "StopReason",
    "StructuredOutputs",
    "Tool",
    "TopLogprobs",
    "Trajectory",
    "bad_word_token_ids",
    "check_constraints",
    "training_feature",
]
