"""Response pieces in vLLM's shapes: token names, log-prob blocks, choice texts.

vLLM's server is the reference: the legacy completions ``logprobs`` block
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, the
sampled token first in each ``top_logprobs`` dict), ``prompt_logprobs`` as
``{token_id: {logprob, rank, decoded_token}}`` per prompt position (the first
``None``), ``token_id:N`` names with ``return_tokens_as_token_ids``, and
log-probs clamped at -9999 (JSON has no infinity).
"""

from __future__ import annotations

from typing import Any

from twinkle_core.data_format import SampledSequence
from twinkle_core.data_format.routes import encode_routes

__all__ = [
    "TokenNames",
    "choice_text",
    "routes_field",
    "stop_reason",
]

#: The floor vLLM clamps log-probs to, so that ``-inf`` (a masked token) stays valid JSON.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


class TokenNames:
    """How tokens are written in log-prob blocks: their text, or ``token_id:N``."""

    def __init__(self, template: Any, as_ids: bool) -> None:
        self.template, self.as_ids = template, as_ids
        self._cache: dict[int, str] = {}

    def text(self, token: int) -> str:
        """The token's own text (special tokens included)."""
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = str(self.template.decode([token], skip_special_tokens=False))
        return found

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.text(token)

    def top(self, token: int, logprob: float | None, alternatives: Any) -> dict[str, float] | None:
        """One position's ``top_logprobs`` dict: the chosen token first, then the alternatives by rank."""
        if logprob is None:
            return None
        out = {self.name(token): _lp(logprob)}
        for alt, value in alternatives or ():
            out.setdefault(self.name(alt), _lp(value))
        return out

    def completion_block(
        self,
        tokens: list[int],
        logprobs: list[float | None],
        tops: list[Any] | None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """The legacy completions ``logprobs`` block over ``tokens`` (``None`` entries: no log-prob there)."""
        names, offsets = [], []
        for t in tokens:
            offsets.append(offset)
            offset += len(self.text(t))
            names.append(self.name(t))
        return {
            "tokens": names,
            "token_logprobs": [None if lp is None else _lp(lp) for lp in logprobs],
            "top_logprobs": [
                self.top(t, lp, tops[i] if tops is not None and i < len(tops) else None)
                for i, (t, lp) in enumerate(zip(tokens, logprobs))
            ],
            "text_offset": offsets,
        }

    def prompt_logprobs(
        self, tokens: list[int], logprobs: list[float | None] | None, tops: list[Any] | None
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per position ``{id: {logprob, rank, decoded_token}}``, the first ``None``.

        The prompt's own token comes first with its rank among the top-k, or
        ``k + 1`` when it is not among them (a lower bound: the engines return
        the top k only).
        """
        out: list[dict[str, dict[str, Any]] | None] = []
        for i, token in enumerate(tokens):
            lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            if lp is None:
                out.append(None)
                continue
            alts = list((tops[i] if tops is not None and i < len(tops) else None) or ())
            ranks = {alt: r + 1 for r, (alt, _) in enumerate(alts)}
            entry = {str(token): self._entry(lp, ranks.get(token, len(alts) + 1), token)}
            for alt, value in alts:
                entry.setdefault(str(alt), self._entry(value, ranks[alt], alt))
            out.append(entry)
        return out

    def _entry(self, logprob: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": _lp(logprob), "rank": rank, "decoded_token": self.name(token)}

    def chat_content(self, tokens: list[int], logprobs: list[float] | None, tops: Any) -> list[dict[str, Any]]:
        """The chat ``logprobs.content`` list."""
        out = []
        for i, t in enumerate(tokens):
            alts = tops[i] if tops is not None and i < len(tops) else []
            name = self.name(t)
            out.append(
                {
                    "token": name,
                    "logprob": _lp(logprobs[i]) if logprobs else 0.0,
                    "bytes": list(self.text(t).encode()),
                    "top_logprobs": [
                        {"token": self.name(a), "logprob": _lp(lp), "bytes": list(self.text(a).encode())}
                        for a, lp in alts
                    ],
                }
            )
        return out


def stop_reason(seq: SampledSequence, eos_token_id: int | None) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string or token id that ended the sequence, ``None`` for EOS or a limit."""
    if seq.stop_reason != "stop" or seq.stop is None or seq.stop == eos_token_id:
        return None
    return seq.stop


def choice_text(seq: SampledSequence, template: Any, *, skip_special_tokens: bool, include_stop: bool) -> str:
    """A choice's text under vLLM's ``skip_special_tokens`` and ``include_stop_str_in_output``.

    The defaults (skip, exclude) are the sequence's own text. Otherwise the
    tokens are decoded again: a final stop token is left out unless it is to
    be included, and the text is cut where the stop string begins.
    """
    if skip_special_tokens and not include_stop:
        return seq.text
    stop = seq.stop if seq.stop_reason == "stop" else None
    if skip_special_tokens:
        text = seq.text
    else:
        tokens = list(seq.tokens)
        if isinstance(stop, int) and tokens and tokens[-1] == stop:
            tokens = tokens[:-1]
        text = str(template.decode(tokens, skip_special_tokens=False))
        if isinstance(stop, str):
            cut = text.find(stop)
            text = text[:cut] if cut >= 0 else text
    if include_stop and isinstance(stop, str):
        text += stop
    elif include_stop and isinstance(stop, int):
        text += str(template.decode([stop], skip_special_tokens=skip_special_tokens))
    return text


def routes_field(routes: Any) -> dict[str, Any]:
    """A choice's ``routed_experts`` (vLLM's name and encoding: base64 ``.npy``), when the request asked for them."""
    return {} if routes is None else {"routed_experts": encode_routes(routes)}
