"""Per-session credentials for direct stage links: an ephemeral certificate
authority and one certificate per stage, made with ``cryptography``.

The orchestrator makes a new authority for each session (each
:class:`~ggufpipe_tui.session.pipeline.Pipeline`) and hands every stage its
own key and certificate, with the authority's certificate, over the stage's
control channel (SSH, or the pipes of a local agent). The authority's private
key never leaves this process, so only the stages of this session can prove
themselves to each other, and the trust root stays the user's SSH: whoever
cannot read a control channel holds no credential. A certificate names its
stage (``stage-<i>.ggufpipe.invalid``) and serves both ends of a link: the
consumer presents it as the TLS server, the producer as the TLS client.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ggufpipe_agent.wire.link_messages import stage_name

#: How long a session's certificates are valid: a session that runs longer
#: keeps its links (certificates are checked when a link is set up).
VALIDITY = datetime.timedelta(days=30)
#: Clocks of the hosts may disagree a little.
CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class StageCredentials:
    name: str  # the DNS name in the certificate
    certificate: bytes  # PEM
    key: bytes  # PEM, unencrypted: it travels inside the control channel only


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class LinkAuthority:
    """An ephemeral CA (ECDSA P-256) and the certificates it issues."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._not_before, self._not_after = now - CLOCK_SKEW, now + VALIDITY
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ggufpipe session authority")])
        self._name = name
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.certificate_pem = certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, stage: int) -> StageCredentials:
        key = ec.generate_private_key(ec.SECP256R1())
        name = stage_name(stage)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return StageCredentials(name, certificate.public_bytes(serialization.Encoding.PEM), _pem_key(key))
