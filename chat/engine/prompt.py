"""Chat template, and fitting a conversation into the context budget."""
from __future__ import annotations

from ..errors import PromptTooLong


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template lists tools itself (Qwen2.5's does)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def with_tools(tokenizer, messages: list, tools: tuple) -> tuple[list, dict]:
    """(messages, template arguments) listing ``tools``: the template's own way where it has one,
    else the generic tool prompt added to the system message."""
    if not tools:
        return messages, {}
    if renders_tools(tokenizer):
        return messages, {"tools": list(tools)}
    from ..structured import tools_prompt
    head = tools_prompt(list(tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{head}"}, *messages[1:]], {}
    return [{"role": "system", "content": head}, *messages], {}


def render(tokenizer, messages: list, tools: tuple = ()) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the answer; when the
    last message is an assistant message marked ``"prefix": True`` (``continue``), its turn is
    left open so the model extends that text instead of starting a new answer."""
    messages, extra = with_tools(tokenizer, messages, tools)
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("prefix"):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True, **extra)
    else:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def _overheads(tokenizer, system: list, tools: tuple = ()) -> tuple[int, int]:
    """(tokens of the system part plus the answer prompt, template tokens around one message)."""
    empty = [{"role": "user", "content": ""}]
    fixed = len(render(tokenizer, system + empty, tools))
    three = len(render(tokenizer, system + empty + [{"role": "assistant", "content": ""}] + empty, tools))
    return fixed, -(-(three - fixed) // 2)


def fit(tokenizer, messages: list, budget: int, tools: tuple = ()) -> tuple[list[int], int]:
    """(prompt ids, turns dropped): the system prompt and the newest turn are kept, whole turns go oldest first.

    Linear in the history: each message is tokenized at most once, newest first,
    stopping as soon as the budget is spent; then only what is kept is rendered.
    Raises ``PromptTooLong`` when even the newest turn alone does not fit.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    # Start each candidate at a user message so the template always sees user/assistant pairs.
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    fixed, per_message = _overheads(tokenizer, system, tools)
    used, counted = fixed, len(turns)
    for i in range(len(turns) - 1, -1, -1):
        used += per_message + len(tokenizer.encode(turns[i]["content"], add_special_tokens=False))
        if used > budget:
            break
        counted = i
    # The oldest turn start whose messages were all counted; the newest turn is always tried.
    candidates = [s for s in starts if s >= counted] or starts[-1:]
    for start in candidates:  # counting is an estimate; the rendered length decides
        ids = render(tokenizer, system + turns[start:], tools)
        if len(ids) <= budget:
            return ids, start
    raise PromptTooLong(f"the message does not fit in the model's context of {budget} tokens")
