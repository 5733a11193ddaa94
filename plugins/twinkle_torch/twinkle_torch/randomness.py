"""Random numbers for sampling: per-sample seeds, and a private stream per seeded row and position.

A seeded request's samples each get a seed of their own (:func:`derive_seed`),
and a seeded row draws at each position of its completion from a stream keyed
on that seed and position (:class:`RowRandomness`), so what a row generates
depends on its seed and position alone: not on its batch, nor on how many
calls it took to get there. The draw itself is :mod:`twinkle_torch.sampling`.
"""

from __future__ import annotations

import random

import torch

__all__ = ["RowRandomness", "derive_seed"]

_MASK64 = (1 << 64) - 1
#: The largest float32 below 1: a double drawn in [0, 1) must not round up to 1.
_BELOW_ONE = 1.0 - 2.0**-24


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``.

    Sample 0 uses ``seed`` itself; sample ``i > 0`` uses a SplitMix64 mix of
    ``(seed, i)``, so the samples of one request differ and requests seeded
    ``s`` and ``s + 1`` do not share streams.
    """
    if index == 0:
        return seed & _MASK64
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _position_seed(seed: int, position: int) -> int:
    """The seed of a row's stream at ``position``: a mix distinct from ``derive_seed``'s sample streams."""
    return derive_seed((seed * 0x2545F4914F6CDD1D + 0x632BE59BD9B4E019) & _MASK64, position + 1)


class RowRandomness:
    """Uniform numbers for the rows of a batch: a private stream per seeded row and position.

    A seeded row draws, at each position of its completion, from a generator
    seeded with its own seed mixed with that position (a ``random.Random``:
    seeding and drawing cost microseconds, against more through a
    ``torch.Generator``, and a batch may hold hundreds of rows): one number
    per step, plus one per rejected draw (see :class:`TokenSampler`), which
    depends on its own logits only. So what a row draws depends on its seed
    and position alone: not on its batch, nor on how many calls it took to get
    there (a sequence stopped and continued from its partial tokens draws what
    the uninterrupted one would have). Unseeded rows draw together from
    torch's global generator, so ``torch.manual_seed`` makes whole runs repeatable.

    Args:
        seeds: per row, the seed (already derived per sample) or ``None``.
        positions: per row, the completion position of its next token
            (tokens generated before this run); default 0.
    """

    def __init__(self, seeds: list[int | None], positions: list[int] | None = None) -> None:
        self._seeds = list(seeds)
        self._positions = list(positions) if positions is not None else [0] * len(seeds)
        self._generators: list[random.Random | None] = [None] * len(seeds)
        self._any_seeded = any(seed is not None for seed in seeds)

    def select(self, rows: list[int]) -> None:
        """Keep the rows ``rows`` (indices into the current rows), in that order."""
        self._seeds = [self._seeds[i] for i in rows]
        self._positions = [self._positions[i] for i in rows]
        self._generators = [self._generators[i] for i in rows]

    def redraw(self, rows: list[int]) -> torch.Tensor:
        """One more ``U[0, 1)`` number at the current position for each of ``rows``, on the CPU."""
        if not self._any_seeded:
            return torch.rand(len(rows))
        gens = [self._generators[i] for i in rows]
        shared = torch.rand(len(rows)).tolist() if any(g is None for g in gens) else None
        values = [
            min(g.random(), _BELOW_ONE) if g is not None else shared[i]  # type: ignore[index]
            for i, g in enumerate(gens)
        ]
        return torch.tensor(values, dtype=torch.float32)

    def uniforms(self, device: torch.device) -> torch.Tensor:
        """Move every row to its next position and draw its first number there."""
        if self._any_seeded:
            for i, seed in enumerate(self._seeds):
                if seed is not None:
                    self._generators[i] = random.Random(_position_seed(seed, self._positions[i]))
                self._positions[i] += 1
        return self.redraw(list(range(len(self._seeds)))).to(device, non_blocking=True)
