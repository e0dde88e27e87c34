"""Chinese, Japanese and Korean text for search: written without spaces between words, so a word
tokenizer sees a whole run (a sentence) as one token. Each run is indexed as overlapping bigrams
instead ("中文介绍" -> "中文 文介 介绍 绍": the last character alone, so a one-character query
finds it too); a query run becomes the phrase of its bigrams, which matches it anywhere."""
from __future__ import annotations

import re

# Han (with extension A, the compatibility block and the supplementary planes), kana, bopomofo,
# Hangul syllables and jamo, halfwidth katakana. Punctuation (U+3000-303F, the katakana middle dot
# U+30FB) is left out: it separates runs as spaces do.
RUN = re.compile("[\u1100-\u11ff\u3040-\u30fa\u30fc-\u30ff\u3100-\u312f\u3130-\u318f\u31f0-\u31ff"
                 "\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f]+")


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds any CJK character."""
    return RUN.search(text) is not None


def run_grams(run: str) -> list[str]:
    """The bigrams of one run, then its last character alone (a one-character run: itself)."""
    return [run[i:i + 2] for i in range(len(run) - 1)] + [run[-1]]


def grams(text: str) -> str:
    """The text the CJK index holds for ``text``: every run's bigrams, space-separated ("" if none)."""
    return " ".join(g for run in RUN.findall(text) for g in run_grams(run))


def split(word: str) -> list[tuple[bool, str]]:
    """A query word cut into its CJK runs and the parts between them: [(is_cjk, part), ...]."""
    out: list[tuple[bool, str]] = []
    at = 0
    for match in RUN.finditer(word):
        if match.start() > at:
            out.append((False, word[at:match.start()]))
        out.append((True, match.group()))
        at = match.end()
    if at < len(word):
        out.append((False, word[at:]))
    return out
