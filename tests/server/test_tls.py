"""TLS on the OpenAI port with a self-signed certificate made here (cryptography, no openssl CLI)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mlxcel.server.tls import TLSError, load_tls
from tests.server.test_access import KEY, LoggedServer, clean_env, key_file, run_serve
from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]


def make_certificate(directory: Path, name: str = "mlxcel-test") -> tuple[Path, Path]:
    """A self-signed server certificate for 127.0.0.1 and localhost; returns (cert.pem, key.pem, mode 0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tiny_llama, certificate, tmp_path_factory):
    """HTTPS with an API key on 127.0.0.1."""
    cert, key = certificate
    keys = key_file(tmp_path_factory.mktemp("tls-keys"), KEY)
    server = LoggedServer(tiny_llama, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                          "--api-key-file", str(keys))
    try:
        with httpx.Client(verify=trusting(cert), timeout=10) as c:
            server.wait_ready(c)
        yield server
    finally:
        server.stop()


def test_serves_https_to_a_client_that_trusts_the_certificate(tls_server, certificate):
    assert tls_server.url.startswith("https://127.0.0.1:")
    with httpx.Client(base_url=tls_server.url, verify=trusting(certificate[0]), timeout=30) as c:
        assert c.get("/health").json() == {"status": "ready"}
        assert c.get("/v1/models").status_code == 401  # TLS does not replace the key
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_openai_client_over_tls(tls_server, certificate):
    with httpx.Client(verify=trusting(certificate[0])) as http:
        oa = openai.OpenAI(base_url=f"{tls_server.url}/v1", api_key=KEY, max_retries=0, http_client=http)
        reply = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           extra_body={"ignore_eos": True})  # the random model may sample EOS first
        assert reply.usage.completion_tokens >= 1
        chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_client_that_does_not_trust_the_certificate_fails(tls_server, tmp_path):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_server.url}/health", timeout=10)  # the system trust store
    other, _ = make_certificate(tmp_path, "someone-else")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_server.url}/health", verify=trusting(other), timeout=10)
    oa = openai.OpenAI(base_url=f"{tls_server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        oa.models.list()


def test_plain_http_to_the_tls_port_gets_no_answer(tls_server):
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_server.url.replace("https://", "http://") + "/health", timeout=10)


# --- preflight: bad TLS flags end in one line before anything listens --------------------------------------


def test_load_tls_checks_pairs_files_and_keys(tmp_path, certificate):
    cert, key = certificate
    assert load_tls(None, None) is None
    assert load_tls(str(cert), str(key)).uvicorn_options() == {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    with pytest.raises(TLSError, match="go together"):
        load_tls(str(cert), None)
    with pytest.raises(TLSError, match="cannot read --ssl-keyfile .*missing.key: no such file"):
        load_tls(str(cert), str(tmp_path / "missing.key"))
    _, other_key = make_certificate(tmp_path, "other")
    with pytest.raises(TLSError, match="the key does not match the certificate"):
        load_tls(str(cert), str(other_key))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TLSError, match="not a PEM certificate"):
        load_tls(str(junk), str(key))


def test_encrypted_key_is_refused_without_prompting(tmp_path, certificate):
    cert, key = certificate
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(TLSError, match="is encrypted"):
        load_tls(str(cert), str(locked))


@pytest.mark.parametrize("case", ["mismatch", "wildcard-tls-no-key"])
def test_cli_tls_errors_are_one_line_before_binding(tiny_llama, certificate, tmp_path, case):
    cert, key = certificate
    _, other_key = make_certificate(tmp_path, "other")
    flags, expected = {
        "mismatch": (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)], "does not match"),
        "wildcard-tls-no-key": (["--host", "0.0.0.0", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
                                "refusing to listen on 0.0.0.0 without an API key"),
    }[case]
    r = run_serve(tiny_llama, *flags, env=clean_env())
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error:") and expected in lines[0]
