"""Authentication and TLS, as Pulsar defines them (DESIGN.md §5a).

:mod:`~anabranch.security.authentication` holds the provider interface and the
:class:`~anabranch.security.authentication.AuthenticationService` the broker's sessions and
HTTP middleware consult; ``providers_token``, ``providers_basic`` and ``providers_tls`` are
the three providers; ``tokens`` makes keys and JWTs (``anabranch tokens``); ``tls`` builds
the server-side SSL contexts; ``key_specs`` reads Pulsar's ``file:///`` / ``data:`` values.
"""
