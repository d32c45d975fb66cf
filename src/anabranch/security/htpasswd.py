"""htpasswd files for basic authentication: parsing and password checks.

Supported hashes (Apache's ``htpasswd -B``, ``-m`` and ``-s``): bcrypt (``$2y$``,
``$2a$``, ``$2b$``), Apache MD5 (``$apr1$``, implemented here: the ``crypt`` module is
gone from Python 3.13) and ``{SHA}`` (base64 SHA-1). Anything else (DES crypt, plain text)
is refused when the file is read, so a typo never silently locks a user out or lets one in.

Example:
    >>> users = parse_htpasswd("# users\\nann:{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g=\\n")
    >>> check_password(users["ann"], "password"), check_password(users["ann"], "nope")
    (True, False)
    >>> apr1_md5("password", "xxxxxxxx")
    '$apr1$xxxxxxxx$dxHfLAsjHkDRmG83UXe8K0'
"""

from __future__ import annotations

import base64
import hashlib
import hmac

import bcrypt

from anabranch.errors import InvalidArgument

_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_BCRYPT_PREFIXES = ("$2y$", "$2a$", "$2b$")


def parse_htpasswd(text: str) -> dict[str, str]:
    """``user -> hash`` from an htpasswd file's text (blank lines and ``#`` comments
    skipped). InvalidArgument names the line number of a bad line, never its content."""
    users: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep or not user or not hashed:
            raise InvalidArgument(f"htpasswd line {number} is not user:hash")
        if not is_supported_hash(hashed):
            raise InvalidArgument(
                f"htpasswd line {number}: unsupported hash (use bcrypt, $apr1$ or {{SHA}})"
            )
        users[user] = hashed
    return users


def is_supported_hash(hashed: str) -> bool:
    """Whether :func:`check_password` understands ``hashed``."""
    return hashed.startswith((*_BCRYPT_PREFIXES, "$apr1$", "{SHA}"))


def check_password(hashed: str, password: str) -> bool:
    """Whether ``password`` matches ``hashed`` (constant-time comparisons; bcrypt costs
    tens of milliseconds, so the broker calls this off the event loop)."""
    secret = password.encode("utf-8")
    if hashed.startswith(_BCRYPT_PREFIXES):
        # bcrypt's library knows $2b$; $2y$ (PHP/Apache) is the same algorithm.
        normalized = "$2b$" + hashed[4:]
        try:
            return bcrypt.checkpw(secret, normalized.encode("ascii"))
        except ValueError:
            return False
    if hashed.startswith("$apr1$"):
        salt = hashed[len("$apr1$") :].split("$", 1)[0]
        return hmac.compare_digest(apr1_md5(password, salt), hashed)
    if hashed.startswith("{SHA}"):
        digest = base64.b64encode(hashlib.sha1(secret).digest()).decode("ascii")
        return hmac.compare_digest("{SHA}" + digest, hashed)
    return False


def apr1_md5(password: str, salt: str) -> str:
    """Apache's ``$apr1$`` hash of ``password`` with ``salt`` (at most 8 characters used),
    the MD5-crypt algorithm with Apache's magic string."""
    magic = b"$apr1$"
    pw = password.encode("utf-8")
    salt_b = salt.encode("utf-8")[:8]
    ctx = hashlib.md5(pw + magic + salt_b)
    alternate = hashlib.md5(pw + salt_b + pw).digest()
    for remaining in range(len(pw), 0, -16):
        ctx.update(alternate[: min(16, remaining)])
    bits = len(pw)
    while bits:
        ctx.update(b"\0" if bits & 1 else pw[:1])
        bits >>= 1
    final = ctx.digest()
    for i in range(1000):
        round_ = hashlib.md5()
        round_.update(pw if i & 1 else final)
        if i % 3:
            round_.update(salt_b)
        if i % 7:
            round_.update(pw)
        round_.update(final if i & 1 else pw)
        final = round_.digest()
    out = []
    for a, b, c in ((0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 5)):
        out.append(_to64((final[a] << 16) | (final[b] << 8) | final[c], 4))
    out.append(_to64(final[11], 2))
    return f"$apr1${salt_b.decode('utf-8', 'replace')}${''.join(out)}"


def _to64(value: int, count: int) -> str:
    chars = []
    for _ in range(count):
        chars.append(_ITOA64[value & 0x3F])
        value >>= 6
    return "".join(chars)
