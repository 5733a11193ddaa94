"""Device descriptions: ``DeviceMesh`` (how one sampler is laid out) and ``DeviceGroup``."""

from __future__ import annotations

from typing import Any

import attrs

from twinkle_core.errors import InvalidMeshError, did_you_mean

__all__ = ["DEVICE_TYPES", "DeviceGroup", "DeviceMesh"]

DEVICE_TYPES = ("cuda", "cpu")


def _positive(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidMeshError(
            f"{type(inst).__name__}.{attribute.name}={value!r} is invalid: expected an integer >= 1."
        )


@attrs.frozen(kw_only=True)
class DeviceMesh:
    """The parallel layout of one sampler.

    Attributes:
        dp_size: data-parallel replicas (each a full engine; needs remote execution when > 1).
        tp_size: tensor-parallel devices per replica.
    """

    dp_size: int = attrs.field(default=1, validator=_positive)
    tp_size: int = attrs.field(default=1, validator=_positive)

    @classmethod
    def from_sizes(cls, **sizes: Any) -> DeviceMesh:
        """Build a mesh from its sizes (``dp_size=``, ``tp_size=``; each 1 by default).

        Raises:
            InvalidMeshError: an unknown size, or one that is not an integer >= 1.
        """
        known = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(sizes) - set(known))
        if unknown:
            raise InvalidMeshError(
                f"DeviceMesh got unknown size(s) {unknown}: expected {', '.join(known)}."
                + did_you_mean(unknown[0], known)
            )
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        """Devices needed in all: ``dp_size * tp_size``."""
        return self.dp_size * self.tp_size


def _ranks(value: Any) -> Any:
    if isinstance(value, range):
        return list(value)
    return value


def _check_ranks(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool):
        raise InvalidMeshError(f"DeviceGroup.ranks={value!r} is invalid: expected a count >= 1 or a list of ranks.")
    if isinstance(value, int):
        if value < 1:
            raise InvalidMeshError(f"DeviceGroup.ranks={value!r} is invalid: expected a count >= 1 or a list of ranks.")
        return
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value)
        or len(set(value)) != len(value)
    ):
        raise InvalidMeshError(
            f"DeviceGroup.ranks={value!r} is invalid: expected a count >= 1 or a non-empty list of distinct ranks >= 0."
        )


def _check_device(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in DEVICE_TYPES:
        raise InvalidMeshError(
            f"DeviceGroup.device_type={value!r} is invalid: expected one of {', '.join(DEVICE_TYPES)}."
        )


def _check_name(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidMeshError(f"DeviceGroup.name={value!r} is invalid: expected a non-empty string.")


@attrs.frozen(kw_only=True)
class DeviceGroup:
    """A named set of devices that remote samplers are placed on.

    Attributes:
        name: what ``remote_group=`` refers to.
        ranks: how many devices (a count) or which ones (a list of indices).
        device_type: ``"cuda"`` or ``"cpu"``.
        cpus_per_rank: CPU cores reserved with each rank.
    """

    name: str = attrs.field(validator=_check_name)
    ranks: int | list[int] = attrs.field(converter=_ranks, validator=_check_ranks)
    device_type: str = attrs.field(default="cuda", validator=_check_device)
    cpus_per_rank: float = attrs.field(default=1.0)

    @property
    def size(self) -> int:
        """Number of devices in the group."""
        return self.ranks if isinstance(self.ranks, int) else len(self.ranks)

    def check_mesh(self, mesh: DeviceMesh) -> None:
        """Check that ``mesh`` fits this group.

        Raises:
            InvalidMeshError: ``dp_size * tp_size`` exceeds the group's devices.
        """
        if mesh.world_size > self.size:
            raise InvalidMeshError(
                f"DeviceMesh(dp_size={mesh.dp_size}, tp_size={mesh.tp_size}) needs {mesh.world_size} devices but"
                f" group {self.name!r} has {self.size}: lower dp_size or tp_size, or give the group more ranks."
            )
