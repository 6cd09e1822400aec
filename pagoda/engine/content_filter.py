"""The content filter: word lists matched with Aho–Corasick (pyahocorasick), on prompts and on output
as it streams.

    pagoda serve --moderation-words banned.txt --moderation-words zh.txt --moderation-action mask

A list is a UTF-8 file, one term a line (Chinese, English, any script); blank lines and lines that
start with ``#`` are skipped; the list's name is the file's stem. A term is matched after the
normalization below, on both the term and the text:

- Unicode compatibility forms (NFKD, then NFKC): full-width letters, digits and punctuation become
  half-width (``ＢＡＤ`` → ``bad``), the ideographic space a space, ligatures their letters
  (``ﬁ`` → ``fi``), circled / super- / subscript forms their digits or letters, CJK compatibility
  ideographs the unified ones, half-width katakana full-width;
- case folding (``str.casefold``: ``ß`` → ``ss``, final sigma, Turkish dotted I);
- diacritics dropped from Latin, Greek and Cyrillic letters (``café`` → ``cafe``), and the
  combining marks people stack on letters to dodge filters ("zalgo": U+0300–036F, U+1AB0–1AFF,
  U+1DC0–1DFF, U+20D0–20FF, U+FE20–FE2F) dropped wherever they stand; marks of other scripts
  (kana voicing, Indic vowel signs) are kept;
- invisible characters dropped: format characters (category Cf: zero-width space / joiners,
  soft hyphen, BOM, bidirectional marks) and control characters;
- every kind of white space (tab, newline, no-break space, ideographic space, ...) is one space,
  and runs of it one space;
- a few Cyrillic and Greek letters that look like Latin ones read as those (``раypal`` with a
  Cyrillic р and а → ``paypal``).

Not folded: traditional / simplified Chinese (list both forms), leetspeak (``b4d``) and separators
put between the letters of a term (``b.a.d``, ``法 轮``).

Terms whose first (last) character is a letter or digit of a script written with spaces between
words (Latin, Greek, Cyrillic, ...) match only at a word boundary there, so ``ass`` does not hit
``class``; a ``*`` at that end of the line lifts it (``*fuck*`` hits inside words). Chinese,
Japanese, Korean and Thai terms match anywhere.

Input: ``Moderation.check_input`` answers the first list a text hits (the server answers 400,
``code: content_filter``, naming the list, not the text). Output: an ``OutputGuard`` per choice
takes the text as it is generated and hands back the text that is safe to send: it holds back the
last ``max_len`` normalized characters (the longest term; one more character of look-ahead is in it
for the word boundary), so a term split across tokens or chunks is caught before any of it leaves.
On a hit, ``stop`` ends the choice (the text before the term is sent, ``finish_reason:
"content_filter"``, its engine request is finished so its KV blocks are freed) and ``mask`` writes
``*`` over the term's characters and goes on. The engine's output processor runs the guards
(pagoda/engine/output_processor.py), so the server, ``LLM`` and ``pagoda.lang`` share them.

The server's policy (its lists plus those of the caller's role) is pagoda/security/moderation.py.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ACTIONS = ("stop", "mask")
MASK = "*"

# -- normalization ------------------------------------------------------------------------------
_ZALGO_MARKS = ((0x0300, 0x036F), (0x1AB0, 0x1AFF), (0x1DC0, 0x1DFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F))
# Cyrillic / Greek lower-case letters drawn like Latin ones (after case folding)
_HOMOGLYPHS = str.maketrans({
    "а": "a", "е": "e", "о": "o", "р": "p", "с": "c", "у": "y", "х": "x", "і": "i", "ј": "j", "ѕ": "s",
    "ԁ": "d", "ԛ": "q", "ԝ": "w", "һ": "h", "ӏ": "l", "ο": "o", "ρ": "p", "ν": "v", "ι": "i", "α": "a",
    "κ": "k", "υ": "u",
})


def _zalgo(code: int) -> bool:
    return any(lo <= code <= hi for lo, hi in _ZALGO_MARKS)


def _accented_script(ch: str) -> bool:
    """Latin, IPA, Greek, Cyrillic (and their extended blocks): diacritics there are dropped."""
    o = ord(ch)
    return o < 0x0530 or 0x1D00 <= o < 0x2000 or 0x2C60 <= o < 0x2C80 or 0xA640 <= o < 0xA800 or 0xAB30 <= o < 0xAB70


def fold_char(ch: str) -> str:
    """One character as the filter compares it: "" (dropped), " " (white space) or its folded form
    (usually one character; compatibility forms may give several)."""
    if ch.isspace():
        return " "
    category = unicodedata.category(ch)
    if category in ("Cf", "Cc", "Cs") or (category in ("Mn", "Me") and _zalgo(ord(ch))):
        return ""
    d = unicodedata.normalize("NFKD", ch)
    if d and _accented_script(d[0]):
        d = "".join(c for c in d if unicodedata.category(c) not in ("Mn", "Me"))
    d = unicodedata.normalize("NFKC", d.casefold()).translate(_HOMOGLYPHS)
    if len(d) > 1:  # compatibility forms with a space or a mark inside (U+00A8 → " ̈")
        d = "".join(" " if c.isspace() else c for c in d
                    if unicodedata.category(c) not in ("Cf", "Cc") and not _zalgo(ord(c)))
    return d


class _FoldTable(dict):
    """code point → folded text, filled on first sight (str.translate's table)."""

    MAX = 100_000  # distinct characters remembered; past that they are folded each time

    def __missing__(self, code: int) -> str:
        folded = fold_char(chr(code))
        if len(self) < self.MAX:
            self[code] = folded
        return folded


_FOLD = _FoldTable()
_SPACE_RUNS = re.compile(" {2,}")


def normalize(text: str) -> str:
    """The text as the filter compares it (the module's docstring says what is folded)."""
    return _SPACE_RUNS.sub(" ", text.translate(_FOLD))


def _no_space_script(o: int) -> bool:
    """Scripts written without spaces between words: CJK, kana, Hangul, Thai, Lao, Myanmar, Khmer."""
    return o >= 0x2E80 or 0x0E00 <= o < 0x0F00 or 0x1000 <= o < 0x10A0 or 0x1780 <= o < 0x1800


def _is_word(ch: str) -> bool:
    return ch.isalnum() and not _no_space_script(ord(ch))


def _utf8(text: str) -> str:
    """`text`'s UTF-8 bytes, one character each: the automaton's alphabet. pyahocorasick finds a
    node's child by a linear scan, so a Chinese list (thousands of distinct first characters at
    the root) was slow; over bytes a node has at most 256 children (a few dozen in practice)
    (benchmarks/README.md, "Content filter overhead"). UTF-8 is self-synchronizing: a term's bytes
    can only match at character boundaries."""
    return text.encode("utf-8").decode("latin-1")


# -- word lists ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hit:
    """A term found: its list, the term as normalized, and where it stands in the original text
    (characters, end exclusive)."""

    list_name: str
    term: str
    start: int
    end: int


def read_list(path: str | Path) -> list[str]:
    """A word list file's terms: one a line, blank lines and ``#`` comments skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"moderation word list {str(path)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"moderation word list {str(path)!r} is not UTF-8 text") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class WordFilter:
    """Named word lists, normalized into one Aho–Corasick automaton."""

    def __init__(self, lists: dict[str, Iterable[str]]) -> None:
        import ahocorasick  # deferred: ahocorasick loads on first use

        self.lists: dict[str, tuple[str, ...]] = {name: tuple(terms) for name, terms in lists.items()}
        self.automaton = ahocorasick.Automaton()
        self.max_len = 0  # the longest normalized term, in characters
        for name, terms in self.lists.items():
            for raw in terms:
                raw = raw.strip()
                key = normalize(raw.strip("*")).strip()
                if not key or _utf8(key) in self.automaton:  # the first list to name a term keeps it
                    continue
                left = not raw.startswith("*") and _is_word(key[0])
                right = not raw.endswith("*") and _is_word(key[-1])
                self.automaton.add_word(_utf8(key), (name, key, len(key), left, right))
                self.max_len = max(self.max_len, len(key))
        self.num_terms = len(self.automaton)
        if self.num_terms:
            self.automaton.make_automaton()

    @classmethod
    def from_files(cls, paths: Sequence[str | Path]) -> "WordFilter":
        """One list per file, named by the file's stem (``banned.txt`` → ``banned``)."""
        lists: dict[str, list[str]] = {}
        for p in paths:
            lists.setdefault(Path(p).stem, []).extend(read_list(p))
        return cls(lists)

    @property
    def names(self) -> list[str]:
        return list(self.lists)

    def combine(self, *others: "WordFilter") -> "WordFilter":
        """This filter's lists and the others' (same-named lists are joined)."""
        lists = {name: list(terms) for name, terms in self.lists.items()}
        for other in others:
            for name, terms in other.lists.items():
                lists.setdefault(name, []).extend(terms)
        return WordFilter(lists)

    def _matches(self, norm: str, prev: str = "", lo: int = 0, hi: int | None = None):
        """(start, end inclusive, list, term) of the terms in normalized text `norm` whose end lies
        in [lo, hi) and whose word boundaries hold. `prev` is the character before `norm` ("": the
        text's start); after `norm`'s last character, the text ends."""
        hi = len(norm) if hi is None else hi
        data = norm.encode("utf-8")
        ascii_only = len(data) == len(norm)
        byte_at = char_at = 0
        for end, (name, term, length, left, right) in self.automaton.iter(data.decode("latin-1")):
            if not ascii_only:  # the byte offset as a character offset (matches come by increasing end)
                char_at += len(data[byte_at:end + 1].decode("utf-8"))
                byte_at, end = end + 1, char_at - 1
            if end < lo or end >= hi:
                continue
            start = end - length + 1
            if left and _is_word(norm[start - 1] if start else (prev or " ")):
                continue
            if right and end + 1 < len(norm) and _is_word(norm[end + 1]):
                continue
            yield start, end, name, term

    def first_list(self, text: str) -> str | None:
        """The list of the first term in `text`, or None (the prompt check)."""
        if not self.num_terms:
            return None
        for _, _, name, _ in self._matches(normalize(text)):
            return name
        return None

    def scan(self, text: str) -> list[Hit]:
        """Every term in `text` (overlapping ones too), with its span in `text`."""
        guard = OutputGuard(self, "mask")
        guard.feed(text, final=True)
        return guard.hits

    def guard(self, action: str = "stop", on_hit: Callable[[str, str], None] | None = None) -> "OutputGuard":
        return OutputGuard(self, action, on_hit)


class OutputGuard:
    """One choice's output through the filter, as it streams: `feed` the new text, get the text
    that is safe to send now. It holds back the last `filter.max_len` normalized characters (the
    longest term, whose word boundary needs the character after it: a term ending one character
    before the held tail is decided). On a hit, "stop" hands out the text before the term and
    refuses anything more (`stopped`); "mask" writes `*` over the term's characters and goes on.
    `final=True` (the choice ended) decides the rest and hands it all out."""

    def __init__(self, word_filter: WordFilter, action: str = "stop",
                 on_hit: Callable[[str, str], None] | None = None) -> None:
        if action not in ACTIONS:
            raise ValueError(f"moderation action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.filter, self.action, self.on_hit = word_filter, action, on_hit
        self.hits: list[Hit] = []
        self.stopped = False  # a hit ended the output ("stop")
        self.closed = False  # stopped, or fed its final text
        self._orig = ""  # text received and not yet handed out
        self._norm = ""  # its normalized form
        self._map: list[int] = []  # per character of _norm: the index in _orig of the character it comes from
        self._prev = ""  # the normalized character before _norm
        self._released = 0  # original characters handed out (or cut) before _orig
        self._decided = 0  # position in _norm: the matches ending before it have been decided

    def feed(self, text: str, final: bool = False) -> str:
        if self.closed:
            return ""
        if not self.filter.num_terms:
            self.closed = final
            return text
        self._append(text)
        norm = self._norm
        decide = len(norm) if final else len(norm) - 1  # a term's right boundary needs the next character
        hits = sorted(self.filter._matches(norm, self._prev, self._decided, decide)) if decide > self._decided else []
        self._decided = max(self._decided, decide)
        for start, end, name, term in hits:
            begin, stop = self._map[start], self._map[end] + 1
            self.hits.append(Hit(name, term, self._released + begin, self._released + stop))
            if self.on_hit is not None:
                self.on_hit(name, "output")
            if self.action == "stop":
                out = self._orig[:begin]
                self.stopped = self.closed = True
                self._orig, self._norm, self._map = "", "", []
                return out
            self._orig = self._orig[:begin] + MASK * (stop - begin) + self._orig[stop:]
        if final:
            out = self._orig
            self.closed = True
            self._orig, self._norm, self._map = "", "", []
            return out
        return self._release(len(norm) - self.filter.max_len)

    def _append(self, text: str) -> None:
        offset = len(self._orig)
        self._orig += text
        last = self._norm[-1:] or self._prev
        chars: list[str] = []
        where: list[int] = []
        fold = _FOLD
        for k, ch in enumerate(text):
            f = fold[ord(ch)]
            if len(f) == 1:
                if f == " " and last == " ":
                    continue
                chars.append(f)
                where.append(offset + k)
                last = f
            else:
                for c in f:
                    if c == " " and last == " ":
                        continue
                    chars.append(c)
                    where.append(offset + k)
                    last = c
        self._norm += "".join(chars)
        self._map += where

    def _release(self, h: int) -> str:
        """Hand out the original text before normalized position `h` (moved back to the start of
        a character that folds into several), keeping the rest."""
        while h > 0 and self._map[h - 1] == self._map[h]:
            h -= 1
        if h <= 0:
            return ""
        cut = self._map[h]
        out = self._orig[:cut]
        self._prev = self._norm[h - 1]
        self._orig, self._norm = self._orig[cut:], self._norm[h:]
        self._map = [m - cut for m in self._map[h:]]
        self._decided -= h
        self._released += cut
        return out


# -- policy -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Moderation:
    """What one request is checked against: a filter, the action on output hits, and whom to tell
    of hits (`on_hit(list name, "input" | "output")`: the server's metrics)."""

    filter: WordFilter
    action: str = "stop"
    on_hit: Callable[[str, str], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"moderation action must be one of {', '.join(ACTIONS)}, got {self.action!r}")

    @classmethod
    def from_files(cls, paths: Sequence[str | Path], action: str = "stop",
                   on_hit: Callable[[str, str], None] | None = None) -> "Moderation":
        return cls(WordFilter.from_files(paths), action, on_hit)

    def check_input(self, texts: str | Iterable[str]) -> str | None:
        """The list of the first term in any of `texts` (each checked on its own), or None."""
        for text in [texts] if isinstance(texts, str) else texts:
            name = self.filter.first_list(text) if text else None
            if name is not None:
                if self.on_hit is not None:
                    self.on_hit(name, "input")
                return name
        return None

    def guard(self) -> OutputGuard:
        return OutputGuard(self.filter, self.action, self.on_hit)


class ContentFilterError(ValueError):
    """A prompt holds a term of a word list (the in-process engine's answer; the server's is a 400)."""

    def __init__(self, list_name: str, what: str = "prompt") -> None:
        super().__init__(f"{what} refused by the content filter (a term of the word list `{list_name}`)")
        self.list_name = list_name
