"""The server's content policy (pagoda/security/moderation.py): its lists plus those of the
caller's role, and hits noted for the audit line."""

from __future__ import annotations

from pagoda.security.moderation import ServerModeration


def test_server_moderation_adds_a_roles_lists(tmp_path):
    (tmp_path / "server.txt").write_text("alpha\n")
    (tmp_path / "role.txt").write_text("beta\n")
    server = ServerModeration.from_args([str(tmp_path / "server.txt")])
    assert server.for_request().check_input("alpha") == "server"
    assert server.for_request().check_input("beta") is None
    with_role = server.for_request([str(tmp_path / "role.txt")])
    assert with_role.check_input("beta") == "role" and with_role.check_input("alpha") == "server"
    assert ServerModeration.from_args(None).for_request() is None  # no lists: nothing to check
    only_role = ServerModeration.from_args(None).for_request([str(tmp_path / "role.txt")])
    assert only_role.check_input("beta") == "role"


def test_a_roles_lists_come_from_the_request_context_and_hits_reach_its_audit(tmp_path):
    """`moderation_words` of the caller's role (auth config, pagoda/security/context.py) add to
    the server's lists; what the filter catches is noted for the audit line."""
    from types import SimpleNamespace

    from pagoda.security.context import CURRENT, RequestContext

    (tmp_path / "server.txt").write_text("alpha\n")
    (tmp_path / "vip.txt").write_text("beta\n")
    seen = []
    server = ServerModeration.from_args([str(tmp_path / "server.txt")], "mask", lambda *hit: seen.append(hit))
    ctx = RequestContext(grant=SimpleNamespace(role=SimpleNamespace(moderation_words=(str(tmp_path / "vip.txt"),))))
    token = CURRENT.set(ctx)
    try:
        moderation = server.for_request()
    finally:
        CURRENT.reset(token)
    assert moderation.check_input("beta") == "vip"
    moderation.guard().feed("alpha and beta", final=True)  # e.g. on the engine's side, outside the context
    assert ctx.filter_hits == ["vip", "server", "vip"]
    assert seen == [("vip", "input"), ("server", "output"), ("vip", "output")]
    assert server.for_request().check_input("beta") is None  # without the role: the server's lists only
