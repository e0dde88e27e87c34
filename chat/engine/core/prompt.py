"""Chat template, and fitting a conversation into the context budget.

Only the template makes control tokens: the template is rendered with a marker in place of each
message's text, and the text is tokenized apart with special tokens split, so ``<|im_start|>``
typed in a message, a system prompt or an attached file stays text (tokens of its characters)
instead of opening a forged turn. Each message's ids depend on that message alone, so a history's
ids are the same turn after turn (prefix-cache reuse).
"""
from __future__ import annotations

import collections
import hashlib
import json
import re
import weakref
from typing import Any

from ...errors import PromptTooLong
from .. import events as thinking

# around a marker: a template that trims the text (``| trim``) strips them, and we see it; neither is touched
# by a template that strips only newlines (Qwen3's ``strip('\n')``, which the text has none of at its ends)
_PAD = " \t\n"
_PAD_AFTER = "\n\t "
_MARK = re.compile("(\ue000M(\\d+)\ue001)")  # private-use characters: no template trims or escapes them


def _marker(i: int) -> str:
    return f"\ue000M{i}\ue001"


def _template(tokenizer: Any, messages: list, extra: dict) -> str:
    """The chat template rendered for ``messages`` (left open for ``continue``, else ready for the answer);
    ``extra``: the template's own arguments (``tools``)."""
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("prefix"):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True, **extra)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Ids of user-controlled text: special tokens' spellings stay text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template lists tools itself (Qwen2.5's does)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def with_tools(tokenizer: Any, messages: list, tools: tuple) -> tuple[list, dict]:
    """(messages, template arguments) listing ``tools``: the template's own way where it has one,
    else the generic tool prompt added to the system message."""
    if not tools:
        return messages, {}
    if renders_tools(tokenizer):
        return messages, {"tools": list(tools)}
    from ...structured import tools_prompt
    head = tools_prompt(list(tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{head}"}, *messages[1:]], {}
    return [{"role": "system", "content": head}, *messages], {}


def options(params: Any) -> dict:
    """The template's own arguments a request sets (``GenParams``): ``enable_thinking`` when it says."""
    flag = getattr(params, "enable_thinking", None)
    return {} if flag is None else {"enable_thinking": flag}


def render(tokenizer: Any, messages: list, tools: tuple = (), extra: dict | None = None) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the answer; when the
    last message is an assistant message marked ``"prefix": True`` (``continue``), its turn is
    left open so the model extends that text instead of starting a new answer. An assistant message's
    ``reasoning_content`` (a thinking model's thinking) goes to the template, which decides whether the
    model sees it (Qwen3's shows it only after the last question); ``extra``: template arguments
    (``enable_thinking``)."""
    messages, args = with_tools(tokenizer, messages, tools)
    args = {**args, **(extra or {})}
    values: list[str] = []  # each marker's text, by its number

    def mark(text: str) -> str:
        values.append(text)
        return _PAD + _marker(len(values) - 1) + _PAD_AFTER

    marked = []
    for m in messages:
        copy = dict(m)
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str):
                copy[key] = mark(m[key])
        marked.append(copy)
    open_turn = bool(messages) and messages[-1]["role"] == "assistant" and bool(messages[-1].get("prefix"))
    last = -1
    if open_turn:  # the open turn ends right after its text (transformers cuts the rest)
        marked[-1]["content"] = marked[-1]["content"][:-len(_PAD_AFTER)]
        last = int(_MARK.search(marked[-1]["content"]).group(2))  # type: ignore[union-attr]
    pieces = _MARK.split(_template(tokenizer, marked, args))
    templates, which = pieces[0::3], [int(i) for i in pieces[2::3]]
    texts = []
    for k, i in enumerate(which):
        text = values[i]
        if templates[k].endswith(_PAD):  # the template took the text as it is, or cut its end
            templates[k] = templates[k][:-len(_PAD)]
            if templates[k + 1].startswith(_PAD_AFTER):
                templates[k + 1] = templates[k + 1][len(_PAD_AFTER):]
            elif i != last:  # the template trims the end (``rstrip``)
                text = text.rstrip()
        else:  # the template trims it
            text = text.strip()
        texts.append(text.rstrip() if i == last else text)
    ids = tokenizer.encode(templates[0], add_special_tokens=False)
    for text, template in zip(texts, templates[1:]):
        ids += text_ids(tokenizer, text)
        ids += tokenizer.encode(template, add_special_tokens=False)
    return ids


def _overheads(tokenizer: Any, system: list, tools: tuple = (), extra: dict | None = None) -> tuple[int, dict]:
    """(tokens of the system part plus the answer prompt, template tokens around a message by role): a history
    that starts with a user message (as every kept one does) costs the first plus each message's own."""
    user, assistant = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
    one = len(render(tokenizer, system + [user], tools, extra))
    pair = len(render(tokenizer, system + [user, assistant, user], tools, extra)) - one
    try:  # what an answer adds: a template may refuse to end on one, or write it apart as the last
        answer = min(max(len(render(tokenizer, system + [user, assistant], tools, extra)) - one, 0), pair)
    except Exception:
        answer = -(-pair // 2)
    return one - (pair - answer), {"user": pair - answer, "assistant": answer, "other": max(answer, pair - answer)}


# Where a cut history starts again: the kept part is brought down to at most this share of the budget.
# A cut is a full prefill of what it keeps (nothing before it is cached for the new start), and the turns
# after it reuse the cache until the kept part fills the budget again: keeping a share ``f`` costs ``f/(1-f)``
# tokens of re-prefill per token the conversation grows (1 at a half; 3 at three quarters; every turn's
# whole prompt if the cut moved by one turn each time, as it did before) while the model sees between
# ``f`` and all of the budget (three quarters on average at a half). Half is llama.cpp's context shift's
# choice too (it discards half of what follows the kept start when its context fills).
CUT_TO = 0.5
_COUNTS_KEPT = 8192  # messages' token counts kept per tokenizer (a 300-turn conversation holds 600)
_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict(digest -> count)


def _count(tokenizer: Any, text: str) -> int:
    """Tokens of a message's text (``text_ids``), remembered by the text's digest so that a long
    conversation is tokenized once, not on every turn (any thread: races only cost a recount)."""
    try:
        counts = _COUNTS.get(tokenizer)
        if counts is None:
            counts = _COUNTS.setdefault(tokenizer, collections.OrderedDict())
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: counted each time
        return len(text_ids(tokenizer, text))
    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    found = counts.get(key)
    if found is not None:
        try:
            counts.move_to_end(key)
        except KeyError:  # another thread let it go meanwhile
            pass
        return found
    found = counts[key] = len(text_ids(tokenizer, text))
    while len(counts) > _COUNTS_KEPT:
        try:
            counts.popitem(last=False)
        except KeyError:
            break
    return found


def _tokens(tokenizer: Any, message: dict) -> int:
    """A message's own tokens: its text and its tool calls (a low count would make ``fit`` cut past
    ``cut_start``'s start, which the next turn's replay does not know). Its thinking is left out: templates
    show it only after the last question (Qwen3), so counting it would waste most of a thinking model's
    context."""
    found = _count(tokenizer, message["content"]) if isinstance(message.get("content"), str) else 0
    if message.get("tool_calls"):
        found += _count(tokenizer, json.dumps(message["tool_calls"], ensure_ascii=False))
    return found


def cut_start(costs: list[int], starts: list[int], steps: list[int], room: int) -> int:
    """Where the kept history starts (an index into the messages): ``costs`` each message's estimated
    tokens, ``starts`` where turns may start (user messages), ``steps`` the messages that each ended a
    request (the prompt ran up to and with them), ``room`` the budget left for messages.

    The history is replayed request by request: the start stays where it is while the messages from it
    up to the step fit ``room``; when they do not, it moves to the first turn start that brings them to
    at most ``CUT_TO`` of ``room`` (else to the step's own turn). So it moves only when the context
    overflows, and the same history always gives the same start: the next turns' prompts extend this
    one (prefix-cache hits). Linear: prefix sums, and a start that only moves forward.
    """
    total = [0]
    for cost in costs:
        total.append(total[-1] + cost)
    target = int(room * CUT_TO)
    k = 0  # starts[k] is the start
    for step in steps:
        if total[step + 1] - total[starts[k]] <= room:
            continue
        last = k
        while last + 1 < len(starts) and starts[last + 1] <= step:
            last += 1
        while k < last and total[step + 1] - total[starts[k]] > target:
            k += 1
    return starts[k]


def fit(tokenizer: Any, messages: list, budget: int, tools: tuple = (), extra: dict | None = None
        ) -> tuple[list[int], int]:
    """(prompt ids, messages dropped): the system prompt and the newest turn are kept, and the history is cut
    at a turn start that stays put from one request to the next until the context overflows (``cut_start``).

    Linear in the history: each message's tokens are counted once (and remembered across requests:
    ``_count``), then only what is kept is rendered. The rendered length decides (counts are estimates):
    should it still pass the budget, later turn starts are tried. Raises ``PromptTooLong`` when even the
    newest turn alone does not fit.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    # Start each candidate at a user message so the template always sees user/assistant pairs.
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    fixed, around = _overheads(tokenizer, system, tools, extra)
    costs = [around.get(m["role"], around["other"]) + _tokens(tokenizer, m) for m in turns]
    # Each earlier request ended at a user message; this one ends at its last message.
    steps = [i for i, m in enumerate(turns[:-1]) if m["role"] == "user"] + [len(turns) - 1]
    first = cut_start(costs, starts, steps, budget - fixed) if turns else 0
    for start in [s for s in starts if s >= first]:
        ids = render(tokenizer, system + turns[start:], tools, extra)
        if len(ids) <= budget:
            return ids, start
    raise PromptTooLong(f"the message does not fit in the model's context of {budget} tokens")


_PREAMBLES: dict = {}  # (tokenizer id, system prompt) -> its preamble ids; a few system prompts in a process


def request_ids(tokenizer: Any, messages: list, params: Any, context: int, most_new: int) -> list[int]:
    """A request's prompt ids (``params``: its GenParams), its history trimmed so that its answer, up to
    ``most_new`` tokens but at most half the ``context``, has room; a raw prompt as it is, or ``PromptTooLong``."""
    budget = context - min(min(params.max_new_tokens, most_new), context // 2)
    if params.raw_prompt:
        ids = tokenizer.encode(messages[-1]["content"])
        if len(ids) > budget:
            raise PromptTooLong(f"the prompt does not fit in the model's context of {budget} tokens")
        return ids
    return fit(tokenizer, messages, budget, params.tools, options(params))[0]


_SUFFIXES: dict = {}  # (tokenizer id, template, its arguments) -> what the template writes after the last message


def _suffix(tokenizer: Any, extra: dict) -> str:
    """The generation prompt the template writes after the last message (with ``extra``, its arguments)."""
    key = (id(tokenizer), getattr(tokenizer, "chat_template", None), tuple(sorted(extra.items())))
    found = _SUFFIXES.get(key)
    if found is None:
        try:
            found = _template(tokenizer, [{"role": "user", "content": _marker(0)}], extra).rpartition(_marker(0))[2]
        except Exception:  # a template that cannot render one question alone: nothing opened
            found = ""
        _SUFFIXES[key] = found
        if len(_SUFFIXES) > 64:
            _SUFFIXES.pop(next(iter(_SUFFIXES)))
    return found


def splitter(tokenizer: Any, messages: list, params: Any) -> thinking.Splitter | None:
    """How a request's answer is split into thinking and answer (``thinking.Splitter``), or None: a model
    that does not think (its template never mentions ``<think>``), a raw prompt, an answer a grammar
    shapes, a ``continue`` (its thinking, if any, is over: the answer goes on)."""
    if params.raw_prompt or params.grammar or not thinking.thinks(getattr(tokenizer, "chat_template", None)):
        return None
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and last.get("prefix"):
        return None
    return thinking.Splitter(inside=thinking.opens(_suffix(tokenizer, options(params))))


def preamble_salt(messages: list, server_system: str, salt: str | None) -> str | None:
    """Whose the preamble of ``messages`` is (PrefixCache): public (None) for the server's own system prompt
    or none at all, else the identity's (``salt``) that chose its system prompt."""
    first = messages[0] if messages else {}
    return None if first.get("role") != "system" or first.get("content") == server_system else salt


def preamble(tokenizer: Any, messages: list) -> list[int]:
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
