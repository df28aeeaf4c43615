"""A logits processor that makes a model write a given script: mlx-lm's own ``logits_processors`` hook."""

from __future__ import annotations

import mlx.core as mx


def force(tokenizer, script: str | list[int], then_eos: bool = False):
    """A logits processor that makes the model emit ``script`` (then the tokenizer's EOS), one use only.

    Args:
        tokenizer: encodes ``script`` (a string) and names the EOS token.
        script: the text, or its token ids.
        then_eos: end with the EOS token, so generation stops there.
    """
    ids = tokenizer.encode(script, add_special_tokens=False) if isinstance(script, str) else list(script)
    if then_eos:
        ids.append(tokenizer.eos_token_id)
    step = {"n": 0}

    def processor(tokens, logits):
        if step["n"] >= len(ids):
            return logits
        mask = mx.full(logits.shape, -1e9, logits.dtype)
        mask[..., ids[step["n"]]] = 0.0
        step["n"] += 1
        return logits + mask

    return processor
