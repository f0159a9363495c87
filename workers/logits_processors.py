"""Logits processors: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, and
the `repetition_penalty` and `min_tokens` extensions.

They turn the target's logits into the logits sampling sees, before temperature, top-k and
top-p (`workers.sampler.processed_probs`), in this order: repetition penalty (CTRL: a token seen
in the prompt or the output has a positive logit divided by r, a negative one multiplied by r),
presence and frequency penalties (OpenAI: `logit -= presence * [count > 0] + frequency *
count` over output tokens), the logit bias (added), then `min_tokens` (EOS and stop token ids
masked while the output is shorter).

Exact with MTP: row j of a verify is the target's prediction after draft j - 1, so its context
is the request's confirmed tokens followed by `drafts[:j]`, and row j's processors count those
drafts as already emitted. Each row's processed distribution is then exactly the one decoding
without MTP samples from at that position, had the drafts before it been emitted; acceptance
runs on it (greedy: argmax of the processed row; sampling: rejection sampling against it), so
greedy output with processors is the same with MTP as without, and sampled output keeps its
distribution.
"""

from __future__ import annotations

import torch

from workers.batch import SamplingSpec


def prompt_token_mask(prompt_token_ids: list[int], vocab: int, device) -> torch.Tensor:
    """[V] bool: the tokens the prompt holds (the repetition penalty's prompt part). A request's
    prompt never changes, so the runner builds this once per request, not at every step (a
    32k-token prompt made into a tensor per step cost milliseconds)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    if prompt_token_ids:
        mask[torch.tensor(prompt_token_ids, device=device)] = True
    return mask


class OutputCounts:
    """A request's output token counts, [V] float on the device, kept across its steps: each
    step adds only the output tokens confirmed since the last, instead of counting the whole
    output again (a 30k-token output made into a tensor per step cost milliseconds). A
    request's confirmed tokens only ever grow (rejected drafts never reach them; a preemption
    recomputes the same tokens), so what was counted stays counted."""

    def __init__(self, vocab: int, device) -> None:
        self.counts = torch.zeros(vocab, device=device)
        self.num_counted = 0

    def update(self, token_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Count `token_ids[start:end]` (the output so far, start = the prompt's length): only
        the part past what earlier steps counted. -> the counts."""
        num_output = end - start
        if num_output < self.num_counted:  # not expected (see above): count afresh
            self.counts.zero_()
            self.num_counted = 0
        if num_output > self.num_counted:
            new = torch.tensor(token_ids[start + self.num_counted : end], device=self.counts.device)
            self.counts += torch.bincount(new, minlength=self.counts.numel()).float()
            self.num_counted = num_output
        return self.counts


def process_logits(
    logits: torch.Tensor,  # [num_drafts + 1, V]
    spec: SamplingSpec,
    context_token_ids: list[int],  # prompt then output, up to row 0's prediction
    draft_token_ids: list[int],
    prompt_mask: torch.Tensor | None = None,  # prompt_token_mask of the prompt; None: built here
    output_counts: torch.Tensor | None = None,  # [V] counts of the output; None: counted here
    context_len: int | None = None,
) -> torch.Tensor:
    """-> fp32 logits [num_drafts + 1, V] after the request's processors. `context_len`: the
    context is `context_token_ids[:context_len]` (the runner passes the history it keeps, drafts
    and all, instead of copying its prefix every step)."""
    num_rows, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    num_prompt = spec.num_prompt_tokens
    if context_len is None:
        context_len = len(context_token_ids)
    num_output = context_len - num_prompt
    if spec.repetition_penalty != 1.0 or spec.presence_penalty or spec.frequency_penalty:
        if output_counts is None:
            output_counts = _count(context_token_ids[num_prompt:context_len], vocab, device)
        counts = _row_counts(output_counts, draft_token_ids, num_rows)  # [num_rows, V]
        if spec.repetition_penalty != 1.0:
            if prompt_mask is None:
                prompt_mask = prompt_token_mask(context_token_ids[:num_prompt], vocab, device)
            seen = (counts > 0) | prompt_mask
            r = spec.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if spec.presence_penalty:
            out -= spec.presence_penalty * (counts > 0).float()
        if spec.frequency_penalty:
            out -= spec.frequency_penalty * counts
    if spec.logit_bias:
        ids = torch.tensor([t for t, _ in spec.logit_bias], device=device)
        bias = torch.tensor([b for _, b in spec.logit_bias], dtype=out.dtype, device=device)
        out[:, ids] += bias  # ids are distinct (a dict's keys)
    # Row j samples output token num_output + j + 1: masked while fewer than min_tokens precede.
    num_masked_rows = min(max(spec.min_tokens - num_output, 0), num_rows)
    if num_masked_rows and spec.min_tokens_masked_ids:
        masked = torch.tensor(spec.min_tokens_masked_ids, device=device)
        out[:num_masked_rows, masked] = float("-inf")
    return out


def _count(token_ids: list[int], vocab: int, device) -> torch.Tensor:
    """[V] float on `device`: how often each token occurs (only the ids travel to the device,
    not a vocabulary-wide tensor)."""
    counts = OutputCounts(vocab, device)
    return counts.update(token_ids, 0, len(token_ids))


def _row_counts(
    output_counts: torch.Tensor, draft_token_ids: list[int], num_rows: int
) -> torch.Tensor:
    """[num_rows, V]: row j counts the output so far plus `draft_token_ids[:j]`."""
    counts = output_counts.expand(num_rows, -1).clone()
    for j, draft in enumerate(draft_token_ids[: num_rows - 1]):
        counts[j + 1 :, draft] += 1
    return counts


def record_step_tokens(token_ids: list[int], start_position: int, step_token_ids: list[int]):
    """Keep a request's token history on the worker: `token_ids[:start_position]` is confirmed
    (the scheduler only advances past verified tokens), anything after it was a rejected draft
    or is recomputed now, so the history becomes that prefix plus this step's tokens (its drafts
    last). A preemption's recompute (start 0) rebuilds it whole. In place."""
    del token_ids[start_position:]
    token_ids.extend(step_token_ids)
