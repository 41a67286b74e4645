"""Is a server on this host? (Payload files through a shared directory only work if so.)"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit


async def is_local_host(url: str) -> bool:
    """True when ``url``'s host is a loopback address or one of this host's own addresses.
    A name that does not resolve counts as not local (payloads then go inline, which always works)."""
    host = urlsplit(url).hostname or ""
    loop = asyncio.get_running_loop()
    try:
        theirs = {a[4][0] for a in await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    if any(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in theirs):
        return True
    try:
        mine = {a[4][0] for a in await loop.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(theirs & mine)
