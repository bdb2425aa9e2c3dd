"""Discovery sources as the configuration names them: `dns:NAME:PORT`, `file:PATH`, and the DNS server to ask.

Parsed here, apart from discovery itself, so the configuration can check them without importing the machinery
that polls them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvcore.config import ConfigError


@dataclass(frozen=True)
class DnsSource:
    """`dns:NAME:PORT`: one worker per A/AAAA record of NAME, all serving HTTP on PORT."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"dns:{self.name}:{self.port}"


@dataclass(frozen=True)
class FileSource:
    """`file:PATH`: a YAML list of workers (strings or {url, events, replay}), or one worker per line."""

    path: str

    def __str__(self) -> str:
        return f"file:{self.path}"


Source = DnsSource | FileSource


def parse_source(text: str) -> Source:
    """Parse `dns:NAME:PORT` or `file:PATH`; raises ConfigError."""
    kind, sep, rest = text.strip().partition(":")
    if sep and kind == "dns":
        name, sep, port = rest.rpartition(":")
        if sep and name and port.isdigit() and 0 < int(port) < 65536:
            return DnsSource(name.rstrip("."), int(port))
        raise ConfigError(f"DNS discovery is dns:NAME:PORT: {text!r}")
    if sep and kind == "file" and rest:
        return FileSource(rest)
    raise ConfigError(f"discovery source must be dns:NAME:PORT or file:PATH: {text!r}")


def parse_nameserver(text: str) -> tuple[str, int]:
    """`IP`, `IP:PORT`, `[V6]:PORT` or a bare IPv6 address -> (address, port); raises ConfigError."""
    text = text.strip()
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"discover_nameserver must be an IP address, optionally with :PORT: {text!r}") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"discover_nameserver has a bad port: {text!r}")
    return host, int(port)
