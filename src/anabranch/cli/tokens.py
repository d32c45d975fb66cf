"""``anabranch tokens``: keys and JWTs for token authentication, like ``pulsar tokens``.

Example:
    $ anabranch tokens create-secret-key --output my-secret.key
    $ anabranch tokens create --secret-key file:///path/my-secret.key --subject alice
    $ anabranch tokens create-key-pair --output-private-key priv.key --output-public-key pub.key
    $ anabranch tokens create --private-key file:///path/priv.key --subject svc --expiry-time 1y
    $ anabranch tokens show eyJhbGciOi...
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Annotated, Literal

import typer

from anabranch.errors import InvalidArgument
from anabranch.security.key_specs import read_key_spec

# jwt and cryptography are imported by the commands that use them: this module is loaded
# by every ``anabranch`` process (brokers too), and they cost ~8 MB of RSS there.

tokens_app = typer.Typer(no_args_is_help=True, help="Keys and tokens for token authentication.")


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    """Write a key file (``secret``: readable by its owner only); BadParameter, like the
    other bad arguments here, when it cannot be written (no such directory, a directory).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> try:
        ...     _write(d / "missing" / "k.key", b"k")
        ... except typer.BadParameter as err:
        ...     print(err.message.replace(str(d), "<dir>"))
        cannot write <dir>/missing/k.key: No such file or directory
    """
    try:
        path.write_bytes(data)
        if secret:
            path.chmod(0o600)
    except OSError as err:
        raise typer.BadParameter(f"cannot write {path}: {err.strerror}") from None


@tokens_app.command("create-secret-key")
def create_secret_key_command(
    output: Annotated[Path | None, typer.Option(help="Write the raw key to this file.")] = None,
    base64_output: Annotated[
        bool, typer.Option("--base64", help="Print the key base64-encoded.")
    ] = False,
) -> None:
    """A new HS256 secret key (the broker's ``token_secret_key``)."""
    from anabranch.security.tokens import create_secret_key

    key = create_secret_key()
    if output is not None:
        _write(output, key, secret=True)
        typer.echo(
            f'wrote {output}; broker setting: token_secret_key = "file://{output.resolve()}"'
        )
    elif base64_output:
        typer.echo(base64.b64encode(key).decode("ascii"))
    else:
        raise typer.BadParameter("give --output FILE or --base64")


@tokens_app.command("create-key-pair")
def create_key_pair_command(
    output_private_key: Annotated[Path, typer.Option(help="Private key file (PKCS#8 DER).")],
    output_public_key: Annotated[Path, typer.Option(help="Public key file (DER).")],
    algorithm: Annotated[str, typer.Option(help="RS256 or ES256.")] = "RS256",
) -> None:
    """A new key pair: the broker gets the public key (``token_public_key``)."""
    from anabranch.security.tokens import create_key_pair

    if algorithm not in ("RS256", "ES256"):
        raise typer.BadParameter("--algorithm is RS256 or ES256")
    alg: Literal["RS256", "ES256"] = "RS256" if algorithm == "RS256" else "ES256"
    private, public = create_key_pair(alg)
    _write(output_private_key, private, secret=True)
    _write(output_public_key, public)
    typer.echo(f"wrote {output_private_key} and {output_public_key}")


@tokens_app.command("create")
def create_command(
    subject: Annotated[str, typer.Option(help="The role the token names.")],
    secret_key: Annotated[
        str | None, typer.Option(help="file:///path or data:;base64,... (HS256).")
    ] = None,
    private_key: Annotated[
        str | None, typer.Option(help="file:///path or data:;base64,... (RS256/ES256).")
    ] = None,
    expiry_time: Annotated[
        str | None, typer.Option(help="Lifetime: 30s, 10m, 2h, 7d, 1y (default: none).")
    ] = None,
    claim: Annotated[str, typer.Option(help="Claim holding the role.")] = "sub",
) -> None:
    """Print a token for ``--subject`` signed with the secret or the private key."""
    from anabranch.security.tokens import create_token, parse_duration_s

    if (secret_key is None) == (private_key is None):
        raise typer.BadParameter("give exactly one of --secret-key and --private-key")
    try:
        key = read_key_spec(secret_key or private_key or "")
        expires = parse_duration_s(expiry_time) if expiry_time else None
        token = create_token(key, subject, expires_in_s=expires, claim=claim)
    except InvalidArgument as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(token)


@tokens_app.command("show")
def show_command(token: Annotated[str, typer.Argument(help="The token.")]) -> None:
    """Print a token's header and claims (not verified)."""
    import jwt

    try:
        header = jwt.get_unverified_header(token)
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as err:
        raise typer.BadParameter(f"not a JWT: {err}") from None
    typer.echo(json.dumps({"header": header, "claims": claims}, indent=2, sort_keys=True))
