"""Rollout routing replay (R3): the trainer's MoE layers take the experts the sampler took.

In a mixture-of-experts model each token's log-prob comes from the experts
its router picked. A trainer whose router scores differ from the sampler's
by float noise, or by a weight update in between, can pick another expert
for some tokens, and those tokens' log-probs then come from another
sub-network: the importance ratio moves for reasons the policy gradient
cannot see. Replay removes that: the sampler returns the experts it used
(``SamplingParams.return_routed_experts``), and under :class:`RoutingReplay`
the trainer's forward routes every recorded token to those experts. The
mixing weights are still computed from the trainer's own router logits at
those experts, with the family's own rule, so the router still gets its
gradient (as in "Stabilizing MoE RL by aligning training and inference
routers", R3).

The families are named in :data:`ROUTER_RULES`: the ``transformers`` router
classes whose third output is the top-k expert ids, and how each turns its
logits into mixing weights. The torch engine records the same routers
(:func:`find_routers`), so a family is either recorded and replayed, or
refused by both.

Like the rest of :mod:`twinkle_core.rl`, torch is imported only when called.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from twinkle_core.data_format.routes import to_routes
from twinkle_core.errors import InvalidInputError, UnsupportedFeatureError

if TYPE_CHECKING:
    import torch

__all__ = ["ROUTER_RULES", "RoutingReplay", "find_routers"]

#: ``transformers`` router class -> how its mixing weights follow from its logits at the chosen experts:
#: ``"softmax"``: softmax over all experts, then the chosen ones (renormalised when ``norm_topk_prob``,
#: which Mixtral always does); ``"softmax_topk"``: softmax over the chosen logits (GPT-OSS);
#: ``"sigmoid"``: sigmoid scores of the chosen ones, renormalised when ``norm_topk_prob``, times
#: ``routed_scaling_factor`` (DeepSeek-V3, whose bias-corrected group choice only picks, never weighs).
ROUTER_RULES: dict[str, str] = {
    "MixtralTopKRouter": "softmax",
    "MiniMaxTopKRouter": "softmax",  # its forward is Mixtral's
    "Qwen2MoeTopKRouter": "softmax",
    "Qwen3MoeTopKRouter": "softmax",
    "Qwen3NextTopKRouter": "softmax",  # these three: Qwen3-MoE's forward
    "Qwen3_5MoeTopKRouter": "softmax",  # Qwen3-MoE's forward, always renormalised
    "FlexOlmoTopKRouter": "softmax",
    "MellumTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax",
    "GptOssTopKRouter": "softmax_topk",
    "DeepseekV3TopkRouter": "sigmoid",
}


def find_routers(model: Any) -> list[tuple[str, Any]]:
    """The MoE routers of ``model`` that :data:`ROUTER_RULES` knows, in model order, with their names."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in ROUTER_RULES]


def _experts_of(router: Any) -> int:
    return int(getattr(router, "num_experts", 0) or router.weight.shape[0])


def replay_weights(router: Any, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mixing weights ``router`` gives ``experts`` ([tokens, top_k]) from its ``logits`` ([tokens, experts])."""
    import torch

    rule = ROUTER_RULES[type(router).__name__]
    if rule == "softmax_topk":
        chosen: torch.Tensor = torch.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)
        return chosen.to(dtype)
    if rule == "sigmoid":
        weights = logits.float().sigmoid().gather(1, experts)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * float(router.routed_scaling_factor)).to(dtype)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


def _as_batch(routes: Any) -> list[Any]:
    """One route array per batch row: a ``[tokens, layers, top_k]`` array is a batch of one."""
    if isinstance(routes, (list, tuple)):
        return [to_routes(r) for r in routes]
    if hasattr(routes, "detach"):  # a torch tensor
        routes = routes.detach().cpu().numpy()
    if getattr(routes, "ndim", 0) == 4:
        return [to_routes(r) for r in routes]
    return [to_routes(routes)]


class RoutingReplay:
    """Under this context, ``model``'s MoE layers route each recorded token to the recorded experts.

    ``routes`` are ``SampledSequence.routed_experts``: one array
    ``[tokens, moe_layers, top_k]`` for a batch of one, or one per batch row
    (a list, or a ``[rows, tokens, layers, top_k]`` array). Row ``b``'s array
    covers the first positions of row ``b`` of the forward's ``input_ids``
    (the prompt and completion, right-padded); a position past it (the last
    completion token, whose routes no sampler forward computed, and padding)
    keeps the router's own choice. Mixing weights come from the model's own
    router logits at the replayed experts (see :data:`ROUTER_RULES`), so
    gradients reach the router. Each forward under the context must have
    ``rows`` rows of at least the routes' length.

    Example::

        seq = response.sequences[0]
        ids = torch.tensor([response.prompt_token_ids + seq.tokens])
        with RoutingReplay(model, seq.routed_experts):
            logits = model(ids).logits

    Raises:
        UnsupportedFeatureError: ``model`` has no router of a family in :data:`ROUTER_RULES`.
        InvalidInputError: the routes were recorded for another model: another
            number of MoE layers, another top-k, an expert id beyond the model's
            experts (raised on entry), or a forward of another batch size or
            fewer positions (raised by the forward).
    """

    def __init__(self, model: Any, routes: Any) -> None:
        self._model = model
        self._routers = find_routers(model)
        if not self._routers:
            raise UnsupportedFeatureError(
                f"RoutingReplay: {type(model).__name__} has no mixture-of-experts router of a known family"
                f" (known: {', '.join(sorted(ROUTER_RULES))}); nothing to replay."
            )
        self._rows = _as_batch(routes)
        layers = len(self._routers)
        top_k = int(self._routers[0][1].top_k)
        experts = min(_experts_of(r) for _, r in self._routers)
        for b, array in enumerate(self._rows):
            if array is None:
                raise InvalidInputError(
                    f"RoutingReplay: routes of row {b} are None: sample with return_routed_experts."
                )
            if array.shape[0] and (array.shape[1] != layers or array.shape[2] != top_k):
                raise InvalidInputError(
                    f"RoutingReplay: routes of row {b} have shape {tuple(array.shape)} ([tokens, layers, top_k]):"
                    f" expected [tokens, {layers}, {top_k}] for {type(model).__name__} ({layers} MoE layers,"
                    f" top-{top_k}); were they recorded for another model?"
                )
            if array.size and int(array.max()) >= experts:
                raise InvalidInputError(
                    f"RoutingReplay: routes of row {b} name expert {int(array.max())}: expected ids below"
                    f" {experts}, the model's experts per layer; were they recorded for another model?"
                )
        self._handles: list[Any] = []
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def _batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The routes as one ``[rows, longest, layers, top_k]`` tensor, and which positions are recorded."""
        import torch

        if self._tensors is None or self._tensors[0].device != device:
            longest = max(a.shape[0] for a in self._rows)
            layers, top_k = len(self._routers), int(self._routers[0][1].top_k)
            routes = torch.zeros(len(self._rows), longest, layers, top_k, dtype=torch.long)
            known = torch.zeros(len(self._rows), longest, dtype=torch.bool)
            for b, array in enumerate(self._rows):
                if array.shape[0]:
                    routes[b, : array.shape[0]] = torch.from_numpy(array.astype("int64"))
                    known[b, : array.shape[0]] = True
            self._tensors = routes.to(device), known.to(device)
        return self._tensors

    def _hook(self, layer: int) -> Any:
        def replay(module: Any, args: Any, output: Any) -> Any:
            import torch

            logits, scores, experts = output
            routes, known = self._batch(experts.device)
            rows = routes.shape[0]
            tokens = experts.shape[0]
            if tokens % rows or tokens // rows < routes.shape[1]:
                raise InvalidInputError(
                    f"RoutingReplay: a forward of {tokens} tokens does not fit routes of {rows} row(s) of"
                    f" {routes.shape[1]} tokens: expected {rows} row(s) of at least {routes.shape[1]} positions."
                )
            width = tokens // rows
            chosen = experts.view(rows, width, -1).clone()
            span = routes.shape[1]
            here = known.unsqueeze(-1).expand(-1, -1, chosen.shape[-1])
            chosen[:, :span] = torch.where(here, routes[:, :, layer].to(chosen.dtype), chosen[:, :span])
            chosen = chosen.view(tokens, -1)
            flat_logits = logits.reshape(tokens, -1)
            return logits, replay_weights(module, flat_logits, chosen.long(), scores.dtype), chosen

        return replay

    def __enter__(self) -> RoutingReplay:
        self._handles = [router.register_forward_hook(self._hook(i)) for i, (_, router) in enumerate(self._routers)]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
