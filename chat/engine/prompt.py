"""Chat template, and fitting a conversation into the context budget."""
from __future__ import annotations

from ..errors import PromptTooLong


def render(tokenizer, messages: list) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the answer; when the
    last message is an assistant message marked ``"prefix": True`` (``continue``), its turn is
    left open so the model extends that text instead of starting a new answer."""
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("prefix"):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    else:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _overheads(tokenizer, system: list) -> tuple[int, int]:
    """(tokens of the system part plus the answer prompt, template tokens around one message)."""
    empty = [{"role": "user", "content": ""}]
    fixed = len(render(tokenizer, system + empty))
    three = len(render(tokenizer, system + empty + [{"role": "assistant", "content": ""}] + empty))
    return fixed, -(-(three - fixed) // 2)


def fit(tokenizer, messages: list, budget: int) -> tuple[list[int], int]:
    """(prompt ids, turns dropped): the system prompt and the newest turn are kept, whole turns go oldest first.

    Linear in the history: each message is tokenized at most once, newest first,
    stopping as soon as the budget is spent; then only what is kept is rendered.
    Raises ``PromptTooLong`` when even the newest turn alone does not fit.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    # Start each candidate at a user message so the template always sees user/assistant pairs.
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    fixed, per_message = _overheads(tokenizer, system)
    used, counted = fixed, len(turns)
    for i in range(len(turns) - 1, -1, -1):
        used += per_message + len(tokenizer.encode(turns[i]["content"], add_special_tokens=False))
        if used > budget:
            break
        counted = i
    # The oldest turn start whose messages were all counted; the newest turn is always tried.
    candidates = [s for s in starts if s >= counted] or starts[-1:]
    for start in candidates:  # counting is an estimate; the rendered length decides
        ids = render(tokenizer, system + turns[start:])
        if len(ids) <= budget:
            return ids, start
    raise PromptTooLong(f"the message does not fit in the model's context of {budget} tokens")


_PREAMBLES: dict = {}  # (tokenizer id, system prompt) -> its preamble ids; a few system prompts in a process


def preamble(tokenizer, messages: list) -> list[int]:
    """The ids every prompt of ``messages``' system prompt starts with, whatever the conversation: the system
    turn and the template up to the first user message's text (the common start of two probes' ids)."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    key = (id(tokenizer), system[0]["content"] if system else None)
    found = _PREAMBLES.get(key)
    if found is None:
        a = render(tokenizer, system + [{"role": "user", "content": "a"}])
        b = render(tokenizer, system + [{"role": "user", "content": "0"}])
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        found = _PREAMBLES[key] = a[:n]
        if len(_PREAMBLES) > 64:  # system prompts set per conversation: keep the map small
            _PREAMBLES.pop(next(iter(_PREAMBLES)))
    return found
