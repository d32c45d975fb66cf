"""Basic authentication (Pulsar's ``AuthenticationProviderBasic``): ``user:password``
checked against an htpasswd file; the role is the user name.

On the wire the data is ``user:password`` (``pulsar.AuthenticationBasic``); over HTTP it is
``Authorization: Basic base64(user:password)``, decoded by the middleware first. bcrypt
and ``$apr1$`` checks run on the provider's own threads (``PASSWORD_CHECK_THREADS``), at
most ``PASSWORD_CHECKS_PENDING_MAX`` at once: wrong passwords, never remembered, cost a
check each, and a flood of them must neither queue in front of storage's threads nor make
new clients wait for minutes. A successful check is remembered (by a SHA-256 of the
credentials, never the password) so a client's repeated HTTP calls stay cheap.

Example:
    >>> import asyncio
    >>> provider = BasicProvider({"ann": "{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g="})
    >>> asyncio.run(provider.authenticate(Credentials(b"ann:password"))).role
    'ann'
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from anabranch import limits
from anabranch.errors import AuthenticationError, InvalidArgument
from anabranch.security.authentication import Authenticated, Credentials
from anabranch.security.htpasswd import check_password, parse_htpasswd
from anabranch.security.key_specs import read_key_spec

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig

VERIFIED_CACHE_MAX = 1024
"""Remembered successful checks (one per distinct user:password); the cache is emptied
when full, which costs one more bcrypt per client at worst."""
CREDENTIALS_BYTES_MAX = 4096
"""Longest ``user:password`` looked at; bcrypt itself reads only 72 bytes."""


class BasicProvider:
    """Checks ``user:password`` against an htpasswd table (see the module docstring)."""

    method = "basic"

    def __init__(self, users: dict[str, str]) -> None:
        self._users = users
        self._verified: set[bytes] = set()
        self._checks = 0
        """Password checks waiting for or running on ``_pool``."""
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: BrokerConfig) -> BasicProvider:
        """From ``basic_auth_conf`` (a path, ``file:///path`` or ``data:;base64,``)."""
        if not config.basic_auth_conf:
            raise InvalidArgument("the basic provider needs basic_auth_conf (an htpasswd file)")
        text = read_key_spec(config.basic_auth_conf).decode("utf-8", "replace")
        return cls(parse_htpasswd(text))

    async def authenticate(self, credentials: Credentials) -> Authenticated:
        data = credentials.data
        if len(data) > CREDENTIALS_BYTES_MAX:
            raise AuthenticationError("credentials too long")
        user_b, sep, password_b = data.partition(b":")
        user = user_b.decode("utf-8", "replace")
        hashed = self._users.get(user)
        if not sep or hashed is None:
            raise AuthenticationError("unknown user or wrong password")
        fingerprint = hashlib.sha256(hashed.encode() + b"\0" + data).digest()
        if fingerprint not in self._verified:
            password = password_b.decode("utf-8", "replace")
            if hashed.startswith("{SHA}"):
                ok = check_password(hashed, password)
            else:
                ok = await self._check_off_loop(hashed, password)
            if not ok:
                raise AuthenticationError("unknown user or wrong password")
            if len(self._verified) >= VERIFIED_CACHE_MAX:
                self._verified.clear()
            self._verified.add(fingerprint)
        return Authenticated(user)

    async def _check_off_loop(self, hashed: str, password: str) -> bool:
        if self._checks >= limits.PASSWORD_CHECKS_PENDING_MAX:
            raise AuthenticationError("too many password checks in progress, retry later")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                limits.PASSWORD_CHECK_THREADS, thread_name_prefix="password-check"
            )
        self._checks += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, check_password, hashed, password)
        finally:
            self._checks -= 1
