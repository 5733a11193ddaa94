"""Sampling breadth: min_tokens, logit bias and allowed ids, bad words, prompt truncation, text options."""

from __future__ import annotations

import pytest

from twinkle_core.data_format import InputFeature, SamplingParams, bad_word_token_ids
from twinkle_core.errors import InvalidSamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, spread_ids, traj

__all__ = ["SamplingOptionTests"]


class SamplingOptionTests(ContractBase):
    """The constraint, bias, penalty, prompt and text options each steer the output as documented."""

    def test_min_tokens_holds_back_stop_ids_and_strings(self, sampler: Sampler) -> None:
        self._declares(sampler, "min_tokens")
        greedy = self.greedy_tokens(sampler, traj(0), max_tokens=8)[0]
        first = greedy[0]
        stopped = sampler.sample(traj(0), greedy_params(max_tokens=8, stop_token_ids=[first]))[0].sequences[0]
        assert stopped.tokens == [first] and stopped.stop_reason == "stop"
        held_back = greedy_params(max_tokens=8, stop_token_ids=[first], min_tokens=4)
        held = sampler.sample(traj(0), held_back)[0].sequences[0]
        assert len(held.tokens) >= 4 and first not in held.tokens[:3], held.tokens
        # a stop string does not end the sequence before min_tokens either
        text = sampler.template.decode(greedy[:1])
        if text.strip():
            early = greedy_params(max_tokens=8, stop=[text.strip()], min_tokens=3)
            seq = sampler.sample(traj(0), early)[0].sequences[0]
            assert len(seq.tokens) >= 3, seq.tokens
        self.assert_still_works(sampler)

    def test_logit_bias_and_allowed_token_ids_steer_the_draw(self, sampler: Sampler) -> None:
        self._declares(sampler, "logit_bias", "allowed_token_ids")
        greedy = self.greedy_tokens(sampler, traj(1), max_tokens=6)[0]
        pushed = next(t for t in spread_ids(sampler.vocab_size or 256, 5, 7) if t != greedy[0])
        down = self.greedy_tokens(sampler, traj(1), max_tokens=6, logit_bias={greedy[0]: -100})[0]
        assert down[0] != greedy[0]
        up = self.greedy_tokens(sampler, traj(1), max_tokens=6, logit_bias={pushed: 100})[0]
        assert up[0] == pushed
        allowed = spread_ids(sampler.vocab_size or 256, 5, 8)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed)
        for seq in sampler.sample([traj(0), traj(2)], params.replace(num_samples=2))[0].sequences:
            assert set(seq.tokens) <= set(allowed), seq.tokens
        # allowing only what min_tokens holds back leaves nothing to draw: a typed error, and the engine goes on
        held = sorted(self.held_back_ids(sampler, SamplingParams()))
        if held and "min_tokens" in sampler.supported_params:
            with pytest.raises(InvalidSamplingParams, match="allowed_token_ids"):
                sampler.sample(traj(0), greedy_params(max_tokens=4, allowed_token_ids=held, min_tokens=2))
        self.assert_still_works(sampler)

    def test_bad_words_over_the_sequence_limit_are_refused(self, sampler: Sampler) -> None:
        """Words that pass ``SamplingParams`` (at most 128) but tokenize to more sequences than that
        (a word and its leading-space form) are an ``InvalidSamplingParams`` on every engine."""
        self._declares(sampler, "bad_words")
        vocab = sampler.vocab_size or 0
        words = None
        for t in spread_ids(vocab or 256, 60, 40):
            word = sampler.template.decode([t]).strip()
            if word and len(bad_word_token_ids(sampler.tokenizer, [word], vocab)) == 2:
                words = [word] + [f"{word}{k}" for k in range(127)]  # 128 words, at least 129 sequences
                break
        if words is None:
            pytest.skip("no word of this tokenizer has a distinct leading-space form")
        with pytest.raises(InvalidSamplingParams, match=r"tokenizes to \d+ token sequences") as info:
            sampler.sample(traj(0), SamplingParams(max_tokens=4, bad_words=words))
        assert info.value.field == "bad_words"
        self.assert_still_works(sampler)

    def test_bad_words_are_never_completed(self, sampler: Sampler) -> None:
        self._declares(sampler, "bad_words")
        vocab = sampler.vocab_size or 0
        greedy = self.greedy_tokens(sampler, traj(3), max_tokens=12)[0]
        word, banned = None, []
        for t in greedy:  # a word the model writes: some of its token sequences occur in the greedy completion
            candidate = sampler.template.decode([t]).strip()
            if not candidate:
                continue
            seqs = bad_word_token_ids(sampler.tokenizer, [candidate], vocab)
            if any(_occurs(seq, greedy) for seq in seqs):
                word, banned = candidate, seqs
                break
        assert word is not None, f"no token of the greedy completion {greedy} is a word of its own"
        for params in (
            greedy_params(max_tokens=12, bad_words=[word]),
            SamplingParams(max_tokens=12, seed=2, bad_words=[word]),
        ):
            for seq in sampler.sample(traj(3), params.replace(num_samples=2))[0].sequences:
                hits = [ids for ids in banned if _occurs(ids, seq.tokens)]
                assert not hits, f"bad word {word!r} ({hits}) completed in {seq.tokens}"

    def test_truncate_prompt_tokens_keeps_the_last_tokens(self, sampler: Sampler) -> None:
        prompt = sampler.encode(traj(1)).input_ids
        assert len(prompt) > 6
        cut = sampler.sample(traj(1), greedy_params(max_tokens=4, truncate_prompt_tokens=6))[0]
        assert cut.prompt_token_ids == prompt[-6:]
        direct = sampler.sample(InputFeature(input_ids=prompt[-6:]), greedy_params(max_tokens=4))[0]
        assert cut.sequences[0].tokens == direct.sequences[0].tokens
        whole = sampler.sample(traj(1), greedy_params(max_tokens=1, truncate_prompt_tokens=-1))[0]
        assert whole.prompt_token_ids == prompt

    def test_include_stop_str_in_output_keeps_the_stop_string(self, sampler: Sampler) -> None:
        self._declares(sampler, "include_stop_str_in_output")
        text = sampler.sample(traj(0), greedy_params(max_tokens=12))[0].sequences[0].text
        stop = next(
            (text[i : i + 3] for i in range(2, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3]), None
        )
        assert stop is not None, f"no stop string to cut the greedy text {text!r} at"
        cut = sampler.sample(traj(0), greedy_params(max_tokens=12, stop=[stop]))[0].sequences[0]
        kept = sampler.sample(traj(0), greedy_params(max_tokens=12, stop=[stop], include_stop_str_in_output=True))
        with_stop = kept[0].sequences[0]
        assert cut.stop == stop and with_stop.tokens == cut.tokens and with_stop.text == cut.text + stop

    def test_skip_special_tokens_and_spaces_between_special_tokens_shape_the_text(self, sampler: Sampler) -> None:
        self._declares(sampler, "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids")
        special = sorted(self.held_back_ids(sampler, SamplingParams()))
        assert special, "no end-of-sequence id to write"
        params = greedy_params(
            max_tokens=3, allowed_token_ids=special[:1] + spread_ids(sampler.vocab_size or 256, 1, 9)
        )
        params = params.replace(logit_bias={special[0]: 50.0}) if "logit_bias" in sampler.supported_params else params
        plain = sampler.sample(traj(0), params)[0].sequences[0]
        assert special[0] in plain.tokens, plain.tokens
        shown = sampler.sample(traj(0), params.replace(skip_special_tokens=False))[0].sequences[0]
        assert plain.tokens == shown.tokens
        assert plain.text == sampler.template.decode(plain.tokens) != shown.text
        assert shown.text == sampler.template.decode(shown.tokens, skip_special_tokens=False)
        tight = params.replace(skip_special_tokens=False, spaces_between_special_tokens=False)
        joined = sampler.sample(traj(0), tight)[0].sequences[0]
        want = sampler.template.decode(joined.tokens, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert joined.text == want


def _occurs(seq: list[int], tokens: list[int]) -> bool:
    n = len(seq)
    return any(tokens[i : i + n] == seq for i in range(len(tokens) - n + 1))
