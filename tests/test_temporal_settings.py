"""The Temporal connection settings: each combination read from the
environment as a process reads it, the arguments Client.connect gets from
them, and the refusals, which name variables and paths but never a key or
what a file holds."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.service import TLSConfig

from roundtable.config import Settings, load_settings
from roundtable.temporal import (
    SECURITY_VARIABLES,
    TemporalSettingsError,
    connect,
    temporal_connection,
)
from tests.tls_proxy import SERVER_NAME, Pki, make_pki

API_KEY = "tmprl-api-key-Zq8sKx2"
PREFIX = "ROUNDTABLE_TEMPORAL_"

Load = Callable[..., Settings]


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch) -> Load:
    """Settings from these ROUNDTABLE_TEMPORAL_* variables and no others."""
    for name in list(os.environ):
        if name.upper().startswith(PREFIX):
            monkeypatch.delenv(name)

    def settings(**variables: str | Path) -> Settings:
        for name, value in variables.items():
            monkeypatch.setenv(PREFIX + name.upper(), str(value))
        return load_settings()

    return settings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def refusal(settings: Settings) -> str:
    with pytest.raises(TemporalSettingsError) as raised:
        temporal_connection(settings)
    return str(raised.value)


def test_unset_is_a_plain_connection_to_the_local_dev_server(load: Load) -> None:
    connection = temporal_connection(load())
    assert connection.client_options() == {
        "target_host": "localhost:7233",
        "namespace": "default",
        "tls": False,
        "api_key": None,
    }
    assert "(plain)" in connection.describe()


def test_empty_values_are_unset(load: Load) -> None:
    """`VAR=` in an env file, as .env.example writes optional values."""
    names = [v.removeprefix(PREFIX).lower() for v in SECURITY_VARIABLES]
    settings = load(**dict.fromkeys(names, ""))
    assert temporal_connection(settings).client_options()["tls"] is False


def test_tls_alone_trusts_the_system_roots(load: Load) -> None:
    options = temporal_connection(
        load(tls="true", address="temporal.example:7233")
    ).client_options()
    assert options["tls"] is True and options["api_key"] is None


def test_tls_must_be_a_boolean(load: Load) -> None:
    with pytest.raises(ValidationError, match="temporal_tls"):
        load(tls="maybe")


def test_an_api_key_turns_tls_on_and_is_never_shown(load: Load) -> None:
    settings = load(
        address="eu-west-1.aws.api.temporal.io:7233", namespace="acme.a1b2c", api_key=API_KEY
    )
    connection = temporal_connection(settings)
    options = connection.client_options()
    assert options["api_key"] == API_KEY and options["tls"] is True
    assert options["namespace"] == "acme.a1b2c"
    shown = [
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        repr(connection),
        connection.describe(),
    ]
    assert not any(API_KEY in text for text in shown)
    assert "API key" in connection.describe()


def test_the_api_key_from_a_file(load: Load, tmp_path: Path) -> None:
    key_file = tmp_path / "temporal-api-key"
    key_file.write_text(f"{API_KEY}\n")  # as `echo KEY > file` leaves it
    options = temporal_connection(load(api_key_file=key_file)).client_options()
    assert options["api_key"] == API_KEY and options["tls"] is True


@pytest.mark.parametrize(
    ("contents", "expected"),
    [
        (None, "No such file or directory"),
        ("directory", "Is a directory"),
        (b"  \n", "is empty"),
        (f"{API_KEY}\nsecond-line".encode(), "must hold the key on one line"),
        (b"\xff\xfe" + API_KEY.encode(), "is not text"),
    ],
)
def test_an_api_key_file_that_cannot_serve_is_named_not_quoted(
    load: Load, tmp_path: Path, contents: bytes | str | None, expected: str
) -> None:
    key_file = tmp_path / "temporal-api-key"
    if contents == "directory":
        key_file.mkdir()
    elif isinstance(contents, bytes):
        key_file.write_bytes(contents)
    message = refusal(load(api_key_file=key_file))
    assert f"{PREFIX}API_KEY_FILE ({key_file})" in message and expected in message, message
    assert API_KEY not in message and "second-line" not in message


def test_mtls_with_a_private_ca_and_a_server_name(load: Load, pki: Pki) -> None:
    settings = load(
        address="10.0.0.7:7233",
        tls_client_cert_path=pki.client_cert,
        tls_client_key_path=pki.client_key,
        tls_server_ca_cert_path=pki.ca_cert,
        tls_server_name=SERVER_NAME,
    )
    connection = temporal_connection(settings)
    tls = connection.client_options()["tls"]
    assert tls == TLSConfig(
        server_root_ca_cert=pki.ca_cert.read_bytes(),
        domain=SERVER_NAME,
        client_cert=pki.client_cert.read_bytes(),
        client_private_key=pki.client_key.read_bytes(),
    )
    assert connection.client_options()["api_key"] is None
    described = connection.describe()
    assert "client certificate" in described and f"server name {SERVER_NAME}" in described
    key_body = pki.client_key.read_text().splitlines()[1]
    assert key_body not in repr(connection) and key_body not in described


def test_a_private_ca_alone_is_server_tls(load: Load, pki: Pki) -> None:
    tls = temporal_connection(load(tls_server_ca_cert_path=pki.ca_cert)).client_options()["tls"]
    assert tls == TLSConfig(server_root_ca_cert=pki.ca_cert.read_bytes())


def test_a_server_name_alone_is_server_tls(load: Load) -> None:
    tls = temporal_connection(load(tls_server_name=SERVER_NAME)).client_options()["tls"]
    assert tls == TLSConfig(domain=SERVER_NAME)


def test_an_api_key_with_a_private_ca(load: Load, pki: Pki) -> None:
    """A self-hosted cluster behind its own CA, with an authorizer taking keys."""
    options = temporal_connection(
        load(api_key=API_KEY, tls_server_ca_cert_path=pki.ca_cert)
    ).client_options()
    assert options["tls"] == TLSConfig(server_root_ca_cert=pki.ca_cert.read_bytes())
    assert options["api_key"] == API_KEY


_CERT_AND_KEY = {"tls_client_cert_path": "client_cert", "tls_client_key_path": "client_key"}

# (variables, what the refusal says); a value naming a Pki field is its path.
BAD_COMBINATIONS = [
    (
        {"tls_client_cert_path": "client_cert"},
        f"{PREFIX}TLS_CLIENT_CERT_PATH is set without {PREFIX}TLS_CLIENT_KEY_PATH",
    ),
    (
        {"tls_client_key_path": "client_key"},
        f"{PREFIX}TLS_CLIENT_KEY_PATH is set without {PREFIX}TLS_CLIENT_CERT_PATH",
    ),
    (
        {"api_key": API_KEY, "api_key_file": "key_file"},
        f"both {PREFIX}API_KEY and {PREFIX}API_KEY_FILE are set",
    ),
    ({"api_key": API_KEY, **_CERT_AND_KEY}, "a connection authenticates with one of them"),
    ({"tls": "false", "api_key": API_KEY}, "an API key needs TLS"),
    ({"tls": "false", "api_key_file": "key_file"}, "an API key needs TLS"),
    (
        {"tls": "false", "tls_server_ca_cert_path": "ca_cert"},
        f"{PREFIX}TLS=false conflicts with {PREFIX}TLS_SERVER_CA_CERT_PATH",
    ),
    (
        {"tls": "false", "tls_server_name": SERVER_NAME},
        f"{PREFIX}TLS=false conflicts with {PREFIX}TLS_SERVER_NAME",
    ),
    (
        {"tls": "false", **_CERT_AND_KEY},
        f"{PREFIX}TLS=false conflicts with {PREFIX}TLS_CLIENT_CERT_PATH",
    ),
    ({"address": "acme.a1b2c.tmprl.cloud:7233"}, "is Temporal Cloud, which takes TLS only"),
    (
        {"address": "acme.a1b2c.tmprl.cloud:7233", "tls": "false"},
        "is Temporal Cloud, which takes TLS only",
    ),
]


@pytest.mark.parametrize(("variables", "expected"), BAD_COMBINATIONS)
def test_bad_combinations_are_refused_by_name(
    load: Load, pki: Pki, tmp_path: Path, variables: dict[str, str], expected: str
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    files = {**vars(pki), "key_file": key_file}
    message = refusal(load(**{name: files.get(v, v) for name, v in variables.items()}))
    assert expected in message
    assert API_KEY not in message


def test_a_certificate_and_its_key_swapped(load: Load, pki: Pki) -> None:
    """Caught here, by name, rather than as a handshake error from the TLS stack."""
    message = refusal(
        load(tls_client_cert_path=pki.client_key, tls_client_key_path=pki.client_cert)
    )
    assert f"{PREFIX}TLS_CLIENT_CERT_PATH ({pki.client_key}) holds no PEM certificate" in message
    assert pki.client_key.read_text().splitlines()[1] not in message


def test_a_key_file_that_is_not_a_key(load: Load, pki: Pki, tmp_path: Path) -> None:
    not_a_key = tmp_path / "key.pem"
    not_a_key.write_text("hunter2-not-a-pem")
    message = refusal(load(tls_client_cert_path=pki.client_cert, tls_client_key_path=not_a_key))
    assert message == f"{PREFIX}TLS_CLIENT_KEY_PATH ({not_a_key}) holds no PEM private key"


def test_an_unreadable_ca_names_its_path(load: Load, tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    message = refusal(load(tls_server_ca_cert_path=missing))
    assert message == (
        f"cannot read {PREFIX}TLS_SERVER_CA_CERT_PATH ({missing}): No such file or directory"
    )


async def test_connect_logs_and_fails_without_the_key(
    load: Load, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed connection's error and every log line, at debug, lack the key."""
    from roundtable.ports import free_port

    settings = load(address=f"127.0.0.1:{free_port()}", api_key=API_KEY)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(RuntimeError) as raised:
        await connect(settings)
    assert API_KEY not in str(raised.value)
    assert API_KEY not in caplog.text
    assert "connecting to Temporal at 127.0.0.1" in caplog.text and "API key" in caplog.text


def test_every_connection_setting_is_one_dev_drops() -> None:
    """`roundtable dev` runs its own plain server and drops SECURITY_VARIABLES;
    a connection setting added later must be among them."""
    connection_fields = {name for name in Settings.model_fields if name.startswith("temporal_")} - {
        "temporal_address",
        "temporal_namespace",
    }
    assert {f"ROUNDTABLE_{n.upper()}" for n in connection_fields} == set(SECURITY_VARIABLES)


def test_a_settings_error_quotes_no_value_read(load: Load, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule across fields fails with the whole input; pydantic would quote
    it (the API key, the database password) in the message every entry point
    prints."""
    monkeypatch.setenv("ROUNDTABLE_DATABASE_URL", "postgresql+asyncpg://rt:db-pass-8Hq@db/rt")
    monkeypatch.setenv("ROUNDTABLE_RUN_LEASE_SECONDS", "5")
    monkeypatch.setenv("ROUNDTABLE_RUN_HEARTBEAT_TIMEOUT_SECONDS", "10")
    with pytest.raises(ValidationError) as raised:
        load(api_key=API_KEY)
    message = str(raised.value)
    assert "must be shorter than ROUNDTABLE_RUN_LEASE_SECONDS" in message
    assert API_KEY[:6] not in message and "db-pass" not in message
    assert "input_value" not in message
