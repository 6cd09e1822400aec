"""The server's content policy: `--moderation-words` / `--moderation-action`, and per request the
lists of the caller's role.

Per request, the server asks ``ServerModeration.for_request()``: its own lists plus those of the
caller's role (``moderation_words`` in ``--auth-config``, from pagoda/security/context.py); hits
are counted in ``pagoda:content_filter_hits_total{list, direction}`` and noted for the audit log.
The filter itself (normalization, word lists, the output guard) is pagoda/engine/content_filter.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagoda.engine.content_filter import ACTIONS, Moderation, WordFilter
from pagoda.security.context import request_context


# -- the server's policy ---------------------------------------------------------------------------
class ServerModeration:
    """The server's content policy: its own lists (`--moderation-words`, maybe none), the action
    (`--moderation-action`), the metrics hook, and per request the lists of the caller's role
    (`moderation_words` of a role in `--auth-config`, read from the request context of
    pagoda/security/context.py), each set of a role's files combined with the server's once."""

    def __init__(self, word_filter: WordFilter | None, action: str = "stop",
                 on_hit: Callable[[str, str], None] | None = None) -> None:
        self.base = Moderation(word_filter, action) if word_filter is not None and word_filter.num_terms else None
        self.action, self.on_hit = action, on_hit
        self._combined: dict[tuple[str, ...], Moderation | None] = {}

    @classmethod
    def from_args(cls, paths: Sequence[str] | None, action: str = "stop",
                  on_hit: Callable[[str, str], None] | None = None) -> "ServerModeration":
        return cls(WordFilter.from_files(paths) if paths else None, action, on_hit)

    def for_request(self, extra_lists: Sequence[str] | None = None) -> Moderation | None:
        """The policy of the request being served (call it in the request's context): the
        server's lists plus `extra_lists`, by default the role's `moderation_words`; hits go to
        the metrics and to the request's audit record."""
        ctx = request_context()
        if extra_lists is None:
            grant = ctx.grant if ctx is not None else None
            extra_lists = getattr(grant.role, "moderation_words", None) if grant is not None else None
        extra = tuple(str(p) for p in extra_lists or ())
        moderation = self.base if not extra else self._with_lists(extra)
        if moderation is None:
            return None

        def on_hit(name: str, direction: str) -> None:
            if self.on_hit is not None:
                self.on_hit(name, direction)
            if ctx is not None:
                ctx.note_filter_hit(name)

        return Moderation(moderation.filter, moderation.action, on_hit)

    def _with_lists(self, extra: tuple[str, ...]) -> Moderation | None:
        if extra not in self._combined:
            own = WordFilter.from_files(extra)
            combined = own if self.base is None else self.base.filter.combine(own)
            self._combined[extra] = Moderation(combined, self.action) if combined.num_terms else None
        return self._combined[extra]


def add_cli_args(p) -> None:
    """`pagoda serve`'s content-filter options."""
    g = p.add_argument_group("content filter (pagoda/security/moderation.py)")
    g.add_argument("--moderation-words", action="append", default=None, metavar="FILE",
                   help="a word list: one term a line (UTF-8; '#' comments); prompts holding a term get 400 "
                        "content_filter, output is checked as it streams (repeatable; the list is named by the "
                        "file's stem)")
    g.add_argument("--moderation-action", default="stop", choices=ACTIONS,
                   help="on a term in the output: stop the choice (finish_reason content_filter, the default) "
                        "or mask it with '*' and go on")
