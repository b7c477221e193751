"""The cluster key and TLS files that guard the internal planes, and the proofs built from them.

One process belongs to one cluster, so its entry point installs its ClusterAuth once
(`install`) and the request and event planes take it from there (`current`) unless given one.
Without a key, everything is as before (no handshake, no signatures).

Request plane (request_plane.py): a mutual HMAC challenge-response on connect, before any
frame is read:
    server -> client   MAGIC + server nonce (32 bytes)
    client -> server   MAGIC + client nonce (32 bytes) + HMAC(k, "client" + both nonces)
    server -> client   HMAC(k, "server" + both nonces)
Fixed-size raw bytes, compared in constant time: nothing is decoded until the peer proved the
key, and the client sends no request to a server that has not proved it either.

Event plane: every message carries a MAC of its payload under k' with its topic as BLAKE2b's
personalization (keyed BLAKE2b is a MAC by design, RFC 7693, and costs a third of an HMAC-SHA256
here: it runs on every load report and KV event), checked before the payload is decoded.
k and k' are derived from the cluster key, one per use, so a proof for one plane is no proof
for the other.
"""

from __future__ import annotations

import hashlib
import hmac
from hashlib import blake2b
import ipaddress
import logging
import os
import ssl
import time
from dataclasses import dataclass

MAGIC = b"TRBN\x00AU1"  # read as a frame length ("TRBN" = 1.4 GB) a keyless peer refuses it at once
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
SERVER_HELLO_BYTES = len(MAGIC) + NONCE_BYTES
CLIENT_PROOF_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
SERVER_PROOF_BYTES = MAC_BYTES
HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated socket is closed after this long
MIN_KEY_BYTES = 16
WARN_EVERY_S = 10.0

_REQUEST_PLANE = b"turbine request-plane v1"
_EVENT_PLANE = b"turbine event-plane v1"
_NATS_REQUEST_PLANE = b"turbine request-plane nats v1"


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.digest(key, label, "sha256")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this process's certificate and key, and the CA its peers' certificates are
    signed by (both sides are verified: mutual TLS)."""

    cert: str
    key: str
    ca: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx  # verifies the server's certificate and that it names the address dialled


class ClusterAuth:
    """What a process proves and checks on the internal planes. `key` None: nothing (today's
    behaviour); `tls` None: plain TCP."""

    def __init__(self, key: bytes | None = None, tls: TlsFiles | None = None):
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the cluster key must have at least {MIN_KEY_BYTES} bytes")
        self.key = key
        self.tls = tls
        self._request_key = _derive(key, _REQUEST_PLANE) if key else b""
        self._event_key = _derive(key, _EVENT_PLANE) if key else b""
        self._nats_request_key = _derive(key, _NATS_REQUEST_PLANE) if key else b""
        self._persons: dict[bytes, bytes] = {}  # topic -> BLAKE2b personalization (at most 16 bytes)
        self._server_ssl: ssl.SSLContext | None = None
        self._client_ssl: ssl.SSLContext | None = None

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def allows_control(self, authorization: str | None) -> bool:
        """Whether an HTTP control request (a worker's status-port /engine/* routes that change
        state) may act: with a key, its `Authorization: Bearer <cluster key>` must match."""
        if self.key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key)

    # -- request plane ----------------------------------------------------------------
    def server_hello(self) -> tuple[bytes, bytes]:
        """(our nonce, the bytes to send)."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce, MAGIC + nonce

    def client_proof(self, hello: bytes) -> tuple[bytes, bytes] | None:
        """For the server's hello: (both nonces, the bytes to send), or None if it is no hello."""
        if len(hello) != SERVER_HELLO_BYTES or not hello.startswith(MAGIC):
            return None
        nonces = hello[len(MAGIC):] + os.urandom(NONCE_BYTES)
        proof = MAGIC + nonces[NONCE_BYTES:] + self._mac(b"client", nonces)
        return nonces, proof

    def check_client_proof(self, server_nonce: bytes, proof: bytes) -> bytes | None:
        """The server's proof to send back if the client's `proof` is right, else None."""
        if len(proof) != CLIENT_PROOF_BYTES:
            return None
        magic, client_nonce, mac = proof[:len(MAGIC)], proof[len(MAGIC):-MAC_BYTES], proof[-MAC_BYTES:]
        nonces = server_nonce + client_nonce
        ok = hmac.compare_digest(mac, self._mac(b"client", nonces))
        if not (ok and hmac.compare_digest(magic, MAGIC)):
            return None
        return self._mac(b"server", nonces)

    def check_server_proof(self, nonces: bytes, proof: bytes) -> bool:
        return hmac.compare_digest(proof, self._mac(b"server", nonces))

    def _mac(self, role: bytes, nonces: bytes) -> bytes:
        return hmac.digest(self._request_key, role + nonces, "sha256")

    def server_ssl(self) -> ssl.SSLContext | None:
        if self.tls is not None and self._server_ssl is None:
            self._server_ssl = self.tls.server_context()
        return self._server_ssl

    def client_ssl(self) -> ssl.SSLContext | None:
        if self.tls is not None and self._client_ssl is None:
            self._client_ssl = self.tls.client_context()
        return self._client_ssl

    # -- event plane ------------------------------------------------------------------
    def sign(self, topic: bytes, payload: bytes) -> bytes:
        """`payload` with its signature appended (unchanged without a key)."""
        return self._signed(self._event_key, topic, payload)

    def verified(self, topic: bytes, signed: bytes) -> bytes | None:
        """The payload if its signature is right (or there is no key), else None."""
        return self._verified(self._event_key, topic, signed)

    # -- request plane over NATS: messages signed as events are, under a key of their own --
    def sign_batch(self, subject: bytes, payload: bytes) -> bytes:
        """A NATS request-plane message to `subject`, signed (unchanged without a key)."""
        return self._signed(self._nats_request_key, subject, payload)

    def verified_batch(self, subject: bytes, signed: bytes) -> bytes | None:
        """The payload of a NATS request-plane message that arrived on `subject`, if its signature is
        right (or there is no key), else None."""
        return self._verified(self._nats_request_key, subject, signed)

    def _signed(self, key: bytes, topic: bytes, payload: bytes) -> bytes:
        if not key:
            return payload
        return payload + self._mac_of(key, topic, payload)

    def _verified(self, key: bytes, topic: bytes, signed: bytes) -> bytes | None:
        if not key:
            return signed
        if len(signed) < MAC_BYTES:
            return None
        payload, mac = signed[:-MAC_BYTES], signed[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac_of(key, topic, payload)):
            return None
        return payload

    def _mac_of(self, key: bytes, topic: bytes, payload: bytes | memoryview) -> bytes:
        person = self._persons.get(topic)
        if person is None:
            person = self._persons[topic] = topic if len(topic) <= 16 else blake2b(topic, digest_size=16).digest()
        return blake2b(payload, key=key, person=person, digest_size=MAC_BYTES).digest()


_current = ClusterAuth()


def install(auth: ClusterAuth) -> None:
    """Make `auth` this process's (its entry point calls this once, before any plane opens)."""
    global _current
    _current = auth


def current() -> ClusterAuth:
    return _current


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a listener on this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def key_fingerprint(key: bytes) -> str:
    """Safe to log: tells two processes' keys apart without revealing them."""
    return hashlib.sha256(b"turbine key id" + key).hexdigest()[:12]


class RateLimitedWarning:
    """Logs the first occurrence, then at most one line per WARN_EVERY_S with the count since:
    a flood of bad peers must not flood the log."""

    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._last = -WARN_EVERY_S
        self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < WARN_EVERY_S:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} more like it in the last {now - self._last:.0f}s)"
        self._last, self._suppressed = now, 0
        self._log.warning(msg, *args)
