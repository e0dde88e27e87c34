"""Chat template, and fitting a conversation into the context budget.

Only the template makes control tokens: the template is rendered with a marker in place of each
message's text, and the text is tokenized apart with special tokens split, so ``<|im_start|>``
typed in a message, a system prompt or an attached file stays text (tokens of its characters)
instead of opening a forged turn. Each message's ids depend on that message alone, so a history's
ids are the same turn after turn (prefix-cache reuse).
"""
from __future__ import annotations

import re

from ..errors import PromptTooLong

_PAD = " \t\n"  # around a marker: a template that trims the text (``| trim``) strips it, and we see it
_MARK = re.compile("(\ue000M(\\d+)\ue001)")  # private-use characters: no template trims or escapes them


def _marker(i: int) -> str:
    return f"\ue000M{i}\ue001"


def _template(tokenizer, messages: list) -> str:
    """The chat template rendered for ``messages`` (left open for ``continue``, else ready for the answer)."""
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("prefix"):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def text_ids(tokenizer, text: str) -> list[int]:
    """Ids of user-controlled text: special tokens' spellings stay text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def render(tokenizer, messages: list) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the answer; when the
    last message is an assistant message marked ``"prefix": True`` (``continue``), its turn is
    left open so the model extends that text instead of starting a new answer."""
    marked = [{**m, "content": _PAD + _marker(i) + _PAD} for i, m in enumerate(messages)]
    open_turn = bool(messages) and messages[-1]["role"] == "assistant" and bool(messages[-1].get("prefix"))
    if open_turn:  # the open turn ends right after its text (transformers cuts the rest)
        marked[-1]["content"] = _PAD + _marker(len(messages) - 1)
    pieces = _MARK.split(_template(tokenizer, marked))
    templates, which = pieces[0::3], [int(i) for i in pieces[2::3]]
    texts = []
    for k, i in enumerate(which):
        text = messages[i]["content"]
        if templates[k].endswith(_PAD):  # the template took the text as it is
            templates[k] = templates[k][:-len(_PAD)]
            templates[k + 1] = templates[k + 1].removeprefix(_PAD)
        else:  # the template trims it
            text = text.strip()
        texts.append(text.rstrip() if open_turn and i == len(messages) - 1 else text)
    ids = tokenizer.encode(templates[0], add_special_tokens=False)
    for text, template in zip(texts, templates[1:]):
        ids += text_ids(tokenizer, text)
        ids += tokenizer.encode(template, add_special_tokens=False)
    return ids


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
        used += per_message + len(text_ids(tokenizer, turns[i]["content"]))
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
