"""Chat template, and fitting a conversation into the context budget."""
from __future__ import annotations

from ..errors import PromptTooLong


def render(tokenizer, messages: list) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def fit(tokenizer, messages: list, budget: int) -> tuple[list[int], int]:
    """(prompt ids, turns dropped): the system prompt is kept, the oldest turns go first.

    Raises ``PromptTooLong`` when even the last user message alone does not fit.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    # Start each candidate at a user message so the template always sees user/assistant pairs.
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    for dropped, start in enumerate(starts):
        ids = render(tokenizer, system + turns[start:])
        if len(ids) <= budget:
            return ids, start
        if dropped == 0 and len(starts) > 2:
            # Skip ahead: cheaper than re-rendering every prefix of a long conversation.
            last = render(tokenizer, system + turns[starts[-1]:])
            if len(last) > budget:
                break
    raise PromptTooLong(f"the message does not fit in the model's context of {budget} tokens")
