"""Device descriptions are validated value objects."""

from __future__ import annotations

import pytest

from twinkle_core import DeviceGroup, DeviceMesh
from twinkle_core.errors import InvalidMeshError


def test_mesh_sizes():
    m = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    assert (m.dp_size, m.tp_size, m.world_size) == (2, 2, 4)
    assert DeviceMesh.from_sizes() == DeviceMesh(dp_size=1, tp_size=1)


@pytest.mark.parametrize("kw", [{"dp_size": 0}, {"tp_size": -1}, {"dp_size": 1.5}, {"tp_size": True}])
def test_bad_mesh_sizes(kw):
    with pytest.raises(InvalidMeshError, match=f"{next(iter(kw))}="):
        DeviceMesh.from_sizes(**kw)


def test_unknown_mesh_sizes_are_named():
    with pytest.raises(InvalidMeshError, match=r"unknown size\(s\) \['dp'\]: expected dp_size, tp_size"):
        DeviceMesh.from_sizes(dp=2)


def test_groups_and_fit():
    g = DeviceGroup(name="sampler", ranks=4, device_type="cpu")
    assert g.size == 4
    assert DeviceGroup(name="s", ranks=range(2)).ranks == [0, 1]
    g.check_mesh(DeviceMesh.from_sizes(dp_size=2, tp_size=2))
    with pytest.raises(InvalidMeshError, match="needs 6 devices but group 'sampler' has 4"):
        g.check_mesh(DeviceMesh.from_sizes(dp_size=3, tp_size=2))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "", "ranks": 1}, "name=''"),
        ({"name": "g", "ranks": 0}, "ranks=0"),
        ({"name": "g", "ranks": [0, 0]}, "distinct"),
        ({"name": "g", "ranks": 1, "device_type": "tpu"}, "device_type='tpu'.*cuda, cpu"),
    ],
)
def test_bad_groups(kw, match):
    with pytest.raises(InvalidMeshError, match=match):
        DeviceGroup(**kw)
