"""Recording routed experts: the experts each MoE layer sent each token to, per forward.

``SamplingParams.return_routed_experts`` asks for them. The routers are the
ones :func:`twinkle_core.rl.routing.find_routers` names (the families the
trainer-side replay knows), so what the engine records the trainer can
replay. A forward hook on each router keeps its third output (the top-k
expert ids of every token of the forward, flattened ``[rows x positions]``);
after the forward the decoder takes them as one ``[rows, positions, layers,
top_k]`` array and hands each row its part (see ``decoding.py``). Hooks are
installed once and do nothing unless the recorder is armed for the forward,
so a run that does not ask pays one Python call per MoE layer and forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from twinkle_core.data_format.routes import routes_dtype
from twinkle_core.rl.routing import find_routers

__all__ = ["RouteRecorder"]


class RouteRecorder:
    """Forward hooks on ``model``'s MoE routers that keep the expert ids of an armed forward.

    Args:
        model: a ``transformers`` causal LM (with or without MoE layers).
    """

    def __init__(self, model: Any) -> None:
        routers = [module for _, module in find_routers(model)]
        self.layers = len(routers)
        self.top_k = int(routers[0].top_k) if routers else 0
        experts = max((int(getattr(r, "num_experts", 0) or r.weight.shape[0]) for r in routers), default=1)
        self.dtype = np.dtype(routes_dtype(experts))
        self.armed = False
        self._taken: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._keep)

    def arm(self) -> None:
        """Keep the expert ids of the next forward (whatever a failed forward left is dropped)."""
        self._taken = []
        self.armed = True

    def _keep(self, module: Any, args: Any, output: Any) -> None:
        # bounded: a forward that failed part-way leaves the recorder armed until the next arm()
        if self.armed and len(self._taken) < self.layers:
            self._taken.append(output[2])

    def take(self, rows: int) -> np.ndarray:
        """The expert ids of the last armed forward of ``rows`` rows: ``[rows, positions, layers, top_k]``.

        Disarms the recorder.
        """
        self.armed = False
        taken, self._taken = self._taken, []
        if len(taken) != self.layers:  # a layer not run (a forward that failed part-way): nothing whole
            raise RuntimeError(f"recorded {len(taken)} of {self.layers} MoE layers in one forward")
        ids = torch.stack(taken, dim=1).to(torch.int32).cpu().numpy()
        return ids.astype(self.dtype, copy=False).reshape(rows, -1, self.layers, self.top_k)
