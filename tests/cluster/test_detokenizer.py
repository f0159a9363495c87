"""Incremental detokenization against a real byte-level BPE tokenizer trained here, and stop
strings that span token boundaries."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cluster.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    num_stop_holdback_chars,
)
from cluster.outputs import make_request_output
from cluster.request import Request, RequestStatus
from cluster.sampling_params import SamplingParams
from cluster.scheduler import Scheduler, SchedulerConfig
from workers.batch import SeqResult

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a serving system batches requests and streams tokens back",
    "the scheduler runs decodes first and then prefills",
    "speculative decoding verifies draft tokens in one step",
    "héllo wörld, ça va? naïve café",
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def _stream(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], list[str]]:
    prompt_ids = tokenizer.encode(prompt).ids
    output_ids = tokenizer.encode(completion).ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.append(t) for t in output_ids]
    assert "".join(deltas) == detok.text
    return output_ids, deltas


@pytest.mark.parametrize(
    "completion",
    [
        "the lazy dog streams tokens back",
        "draft tokens verify in one step, then the scheduler prefills",
        "zebra xylophone qq unseen words",  # falls back to short merges and single bytes
    ],
)
def test_incremental_text_equals_full_decode(tokenizer: Tokenizer, completion: str) -> None:
    output_ids, deltas = _stream(tokenizer, "the quick brown fox", " " + completion)
    assert "".join(deltas) == tokenizer.decode(output_ids) == " " + completion


def test_multibyte_utf8_comes_out_whole(tokenizer: Tokenizer) -> None:
    completion = "héllo 😀 wörld"
    output_ids, deltas = _stream(tokenizer, "say", completion)
    assert "".join(deltas) == completion == tokenizer.decode(output_ids)
    assert all("\ufffd" not in d for d in deltas)
    # The emoji is 4 bytes the tokenizer never merged: 3 tokens yield "" before it appears.
    emoji_ids = tokenizer.encode("😀").ids
    assert len(emoji_ids) == 4
    emoji_deltas = [d for d in deltas if "😀" in d]
    assert len(emoji_deltas) == 1
    first = output_ids.index(emoji_ids[0])
    assert deltas[first : first + 3] == ["", "", ""]


class _DecodeOnly:
    """A tokenizer that is no `tokenizers.Tokenizer` (a slow one, say): only `decode`."""

    def __init__(self, tokenizer: Tokenizer):
        self.decode = tokenizer.decode


class _RaisingStream:
    def step(self, tokenizer, token_id):
        raise Exception("InvalidPrefix")  # what DecodeStream raises, as a plain Exception


COMPLETION = " héllo 😀 wörld, naïve café 👍🏽 the lazy dog"


def test_the_windows_and_the_stream_give_the_same_deltas(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("say").ids
    output_ids = tokenizer.encode(COMPLETION).ids
    streamed = IncrementalDetokenizer(tokenizer, prompt)
    windows = IncrementalDetokenizer(_DecodeOnly(tokenizer), prompt)
    assert streamed._stream is not None and windows._stream is None
    assert [streamed.append(t) for t in output_ids] == [windows.append(t) for t in output_ids]
    assert streamed.text == COMPLETION


def test_a_stream_that_fails_hands_on_to_the_windows_losing_nothing(tokenizer: Tokenizer) -> None:
    """DecodeStream raises where a window's text does not continue its prefix's; the request
    then goes on with the windows from the stream's state, at any token (one inside an open
    multi-byte character included): no text lost or repeated."""
    prompt = tokenizer.encode("say").ids
    output_ids = tokenizer.encode(COMPLETION).ids
    for fail_at in range(len(output_ids)):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = []
        for i, token_id in enumerate(output_ids):
            if i == fail_at:
                detok._stream = _RaisingStream()
            deltas.append(detok.append(token_id))
        assert detok._stream is None
        assert "".join(deltas) == detok.text == COMPLETION, fail_at
        assert all("\ufffd" not in d for d in deltas)


def test_transformers_fast_tokenizer_wrapper(tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    output_ids = fast.encode(" naïve café 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(fast, fast.encode("hi", add_special_tokens=False))
    text = "".join(detok.append(t) for t in output_ids)
    assert text == " naïve café 😀"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<eos>")
    ids = tokenizer.encode("the dog").ids
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    text = "".join(detok.append(t) for t in [ids[0], eos, *ids[1:]])
    assert text == "the dog"


def _boundary_stop_case(tokenizer: Tokenizer, completion: str) -> tuple[list[int], str, int]:
    """A stop string that straddles a token boundary in `completion`'s tokenization."""
    encoding = tokenizer.encode(completion)
    for _, end in encoding.offsets[:-1]:
        if 2 <= end <= len(completion) - 3:
            stop = completion[end - 2 : end + 3]
            if completion.find(stop) == end - 2 and " " not in stop:
                return encoding.ids, stop, end - 2
    raise AssertionError("no boundary found")


def test_stop_string_across_token_boundary(tokenizer: Tokenizer) -> None:
    completion = " speculative decoding verifies draft tokens"
    output_ids, stop, stop_index = _boundary_stop_case(tokenizer, completion)
    # No single token holds the stop string.
    pieces = [tokenizer.decode([t]) for t in output_ids]
    assert not any(stop in p for p in pieces)

    config = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=64,
        block_size_tokens=4,
        num_blocks=33,
        max_model_len=128,
    )
    sched = Scheduler(config, tokenizer=tokenizer)
    prompt_ids = tokenizer.encode("the scheduler").ids
    request = Request("r", prompt_ids, SamplingParams(max_tokens=100, stop=[stop]))
    sched.add(request)
    streamed = ""
    for token_id in output_ids:
        out = sched.schedule()
        sched.update(out, {"r": SeqResult("r", [token_id])})
        streamed += make_request_output(request).new_text
        if request.is_finished:
            break
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == stop
    assert request.output_text == completion[:stop_index] == streamed
    # Ids run through the token that completed the stop string.
    num_kept = len(request.output_token_ids)
    assert stop in tokenizer.decode(output_ids[:num_kept])
    assert stop not in tokenizer.decode(output_ids[: num_kept - 1])


def test_find_stop_string_closed_form() -> None:
    assert find_stop_string("hello world", ["wor", "lo w"]) == (3, "lo w")
    assert find_stop_string("hello world", ["o", "ll"]) == (2, "ll")
    assert find_stop_string("aab", ["a", "aa"]) == (0, "aa")  # tie: the longer one
    assert find_stop_string("hello", ["xyz"]) is None
    assert find_stop_string("abcabc", ["abc"], start_char=1) == (3, "abc")


def test_holdback_is_longest_proper_prefix_suffix() -> None:
    assert num_stop_holdback_chars("the end", ["endgame"]) == 3
    assert num_stop_holdback_chars("the en", ["endgame", "n"]) == 2
    assert num_stop_holdback_chars("abc", ["xyz"]) == 0
    assert num_stop_holdback_chars("ab", ["abc", "b"]) == 2
    assert num_stop_holdback_chars("", ["abc"]) == 0
