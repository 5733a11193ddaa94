"""What the ``twinkle`` group hands each of its commands (click's ``ctx.obj``)."""

from __future__ import annotations

import attrs

__all__ = ["Settings"]


@attrs.frozen
class Settings:
    """The group's settings, read when the command line runs.

    Attributes:
        starting_notice_s: an engine that takes longer than this to start gets a line saying it is starting.
    """

    starting_notice_s: float
