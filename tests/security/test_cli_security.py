"""``anabranch tokens`` and the security options of ``anabranch admin`` (token, token file,
basic, HTTPS with a CA bundle), through typer's CliRunner against a broker in a thread."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from typer.testing import CliRunner

from anabranch.cli.main import app
from anabranch.security.key_specs import read_key_spec
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.certificates import TestPki, TlsSetup
from anabranch.testing.security import TokenAuth

runner = CliRunner()


def run(*args: str, code: int = 0, env: dict[str, str] | None = None) -> str:
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def test_secret_key_and_token(tmp_path: Path) -> None:
    key = tmp_path / "secret.key"
    run("tokens", "create-secret-key", "--output", str(key))
    assert len(key.read_bytes()) == 32
    token = run(
        "tokens", "create", "--secret-key", f"file://{key}", "--subject", "alice",
        "--expiry-time", "1h",
    ).strip()  # fmt: skip
    claims = jwt.decode(token, key.read_bytes(), algorithms=["HS256"])
    assert claims["sub"] == "alice" and "exp" in claims
    shown = json.loads(run("tokens", "show", token))
    assert shown["claims"]["sub"] == "alice"
    assert shown["header"]["alg"] == "HS256"


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
def test_key_pair_and_token(tmp_path: Path, algorithm: str) -> None:
    private, public = tmp_path / "priv.key", tmp_path / "pub.key"
    run(
        "tokens", "create-key-pair", "--output-private-key", str(private),
        "--output-public-key", str(public), "--algorithm", algorithm,
    )  # fmt: skip
    token = run("tokens", "create", "--private-key", f"file://{private}", "--subject", "svc")
    from anabranch.security.tokens import load_public_key

    key = load_public_key(read_key_spec(str(public)))
    assert jwt.decode(token.strip(), key, algorithms=[algorithm])["sub"] == "svc"  # type: ignore[arg-type]


def test_create_needs_exactly_one_key(tmp_path: Path) -> None:
    run("tokens", "create", "--subject", "x", code=2)


class ThreadBroker:
    """A broker on its own loop in a thread (the CLI runs ``asyncio.run`` itself)."""

    def __init__(self, broker: InProcessBroker) -> None:
        self.broker = broker
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> InProcessBroker:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.broker.__aenter__(), self.loop).result()
        return self.broker

    def __exit__(self, *exc: object) -> None:
        try:
            coro = self.broker.__aexit__(None, None, None)
            asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secured(tmp_path: Path, pki: TestPki) -> Iterator[tuple[InProcessBroker, TokenAuth]]:
    auth = TokenAuth()
    broker = InProcessBroker(tmp_path / "data", ledgers="memory", security=TlsSetup(pki, also=auth))
    with ThreadBroker(broker) as running:
        yield running, auth


def tenants(*args: str, code: int = 0, env: dict[str, str] | None = None) -> Any:
    out = run("admin", *args, "tenants", "list", "--output", "json", code=code, env=env)
    return json.loads(out) if code == 0 else out


def test_admin_with_token_options(
    secured: tuple[InProcessBroker, TokenAuth], tmp_path: Path, pki: TestPki
) -> None:
    broker, auth = secured
    assert broker.http_url is not None and broker.node is not None
    http = broker.http_url
    tenants("--admin-url", http, code=1)  # 401 without credentials
    assert "public" in tenants("--admin-url", http, "--auth-token", auth.token("admin"))
    token_file = tmp_path / "admin.jwt"
    token_file.write_text(auth.token("admin") + "\n")
    assert "public" in tenants("--admin-url", http, "--auth-token-file", str(token_file))
    env = {"ANABRANCH_AUTH_TOKEN": auth.token("admin")}
    assert "public" in tenants("--admin-url", http, env=env)
    https = broker.node.https_url
    assert https is not None
    assert "public" in tenants(
        "--admin-url", https, "--tls-trust-certs", str(pki.ca_cert),
        "--auth-token", auth.token("admin"),
    )  # fmt: skip
    # Without the CA the broker's certificate is not trusted: unreachable (exit 2).
    tenants("--admin-url", https, "--auth-token", auth.token("admin"), code=2)
