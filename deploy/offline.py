"""One offline generation through `cluster.llm.LLM`, as `mtpserve generate` prints it."""

from __future__ import annotations

from typing import Any


def generate_once(
    model: str | None,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float | None = None,
    seed: int | None = None,
    **engine_options: Any,
) -> dict[str, Any]:
    """Generate one completion; returns the fields `mtpserve generate --json` prints.

    `engine_options` are `EngineConfig` fields (num_draft_tokens, share_topk, tp_size, ...).
    `temperature` None: the checkpoint's (generation_config.json), else greedy; its other
    sampling defaults (top_p, top_k, ...) apply too.
    """
    from cluster.llm import LLM

    if model is None:
        from workers.default_model import default_model_path

        model = default_model_path()
    llm = LLM(model, **engine_options)
    explicit = {"max_tokens": max_tokens, "seed": seed}
    if temperature is not None:
        explicit["temperature"] = temperature
    elif "temperature" not in llm.engine.sampling_defaults:
        explicit["temperature"] = 0.0  # greedy, what `mtpserve generate` always did
    params = llm.engine.default_sampling_params(**explicit)
    params.validate()
    [out] = llm.generate([prompt], params)
    spec = out.spec
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "completion_token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "mean_tokens_per_round": spec.mean_tokens_per_round if spec is not None else 1.0,
        "acceptance_per_position": list(spec.acceptance_per_position) if spec is not None else [],
    }
