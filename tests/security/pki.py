"""A throwaway PKI for the TLS tests, made with the `openssl` CLI at test time.

The venv has no `cryptography` package; Debian always has `openssl`. Nothing here is
committed: every key lives in a pytest temporary directory.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: CertFiles
    server: CertFiles  # SAN 127.0.0.1 and localhost, signed by ca
    client: CertFiles  # signed by ca
    rogue_client: CertFiles  # signed by a CA the server does not trust
    replica: CertFiles  # SAN 127.0.0.1, signed by ca, for serving and as a client (relays)


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _ca(directory: Path, name: str) -> CertFiles:
    files = CertFiles(directory / f"{name}.crt", directory / f"{name}.key")
    _openssl(
        "req",
        "-x509",
        *_EC_KEY,
        "-keyout",
        files.key,
        "-out",
        files.cert,
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return files


def _leaf(directory: Path, name: str, ca: CertFiles, extensions: str) -> CertFiles:
    files = CertFiles(directory / f"{name}.crt", directory / f"{name}.key")
    csr, ext = directory / f"{name}.csr", directory / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", "-new", *_EC_KEY, "-keyout", files.key, "-out", csr, "-subj", f"/CN={name}")
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca.cert,
        "-CAkey",
        ca.key,
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        files.cert,
        "-extfile",
        ext,
    )
    return files


def make_pki(directory: Path) -> Pki:
    ca, rogue_ca = _ca(directory, "test-ca"), _ca(directory, "rogue-ca")
    server = _leaf(
        directory,
        "server",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client_ext = "extendedKeyUsage=clientAuth\n"
    return Pki(
        ca,
        server,
        _leaf(directory, "client", ca, client_ext),
        _leaf(directory, "rogue-client", rogue_ca, client_ext),
        _leaf(
            directory,
            "replica",
            ca,
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        ),
    )
