"""Where the sidecar listens: "unix:/path/agent.sock" or a plain path (the default,
a 0600 socket), or "tcp:127.0.0.1:7701". Shared by the probe and the sidecar; stdlib only.
"""

from __future__ import annotations

import ipaddress

import os
import stat
import tempfile
from typing import NamedTuple

ENV_ADDRESS = "PHASESCOPE_AGENT"


class Address(NamedTuple):
    """Where the sidecar listens."""

    kind: str  # "unix" or "tcp"
    path: str  # socket path (unix) or host (tcp)
    port: int  # 0 for unix

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.path}:{self.port}"


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/phasescope/agent.sock, else <tmp>/phasescope-<uid>/agent.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    sub = "phasescope" if os.environ.get("XDG_RUNTIME_DIR") else f"phasescope-{os.getuid()}"
    return os.path.join(base, sub, "agent.sock")


MAX_SOCKET_PATH = 107  # bytes of a Unix socket path (sun_path less its NUL) on Linux


def parse_address(text: str | None) -> Address:
    """Parse an address: "unix:PATH", "tcp:HOST:PORT" (port 0-65535; 0 lets a listener pick one), or a
    socket path (it must contain a "/": a bare word is a typo, not a file here). None means
    $PHASESCOPE_AGENT or the default socket. Raises ValueError naming the address and what is allowed."""
    if text is None:
        text = os.environ.get(ENV_ADDRESS) or default_socket_path()
    if not isinstance(text, str):
        raise ValueError(f"address {text!r}: expected a string, unix:/path/agent.sock or tcp:HOST:PORT")
    if text.startswith("tcp:"):
        rest = text[4:].lstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad tcp address {text!r}; expected tcp:HOST:PORT")
        if int(port) > 65535:
            raise ValueError(f"bad tcp address {text!r}: port {int(port)} is outside 0-65535")
        return Address("tcp", host, int(port))
    explicit = text.startswith("unix:")
    if explicit:
        text = text[5:]
    if not text:
        raise ValueError("empty socket path")
    if not explicit and "/" not in text:
        raise ValueError(f"address {text!r}: expected unix:/path/agent.sock, tcp:HOST:PORT or a socket path")
    if len(os.fsencode(text)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {text!r} is {len(os.fsencode(text))} bytes; at most {MAX_SOCKET_PATH}")
    return Address("unix", text, 0)


ENV_TOKEN = "PHASESCOPE_AGENT_TOKEN"  # shared secret a TCP sidecar may require (see events.Session)
# "1": the socket's folder is a volume shared by the trusted containers of one pod (a Kubernetes
# emptyDir, a compose volume), owned by one container's user and writable by the others' group:
# the probe and the agent then skip the ownership/mode checks below (logged once). Set it on both
# containers; never on a host where other users share the folder's parent.
ENV_SHARED_FOLDER = "PHASESCOPE_SOCKET_SHARED"


def shared_folder_declared() -> bool:
    """Whether the operator declared the socket folder a pod-shared volume (see ENV_SHARED_FOLDER)."""
    return os.environ.get(ENV_SHARED_FOLDER, "").strip().lower() in ("1", "true", "yes")


def check_private_folder(folder: str, uid: int | None = None) -> str | None:
    """Why `folder` must not hold our socket, or None when it is safe.

    Safe: a real folder (not a symlink) owned by `uid` (default: ours) or by root, and
    writable by nobody else (no group/other write bit). Anything else lets another local
    user squat the socket path and read what the probe sends. With PHASESCOPE_SOCKET_SHARED=1
    (a pod-shared volume) only "a real folder" is checked.
    """
    uid = os.getuid() if uid is None else uid
    if shared_folder_declared():
        return None if os.path.isdir(folder) and not os.path.islink(folder) else f"{folder} is not a folder"
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"cannot stat {folder}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder (a symlink or a file)"
    if st.st_uid not in (uid, 0):
        return f"{folder} is owned by uid {st.st_uid}, not by uid {uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); it must be 0700"
    return None


def make_private_folder(folder: str, uid: int | None = None) -> None:
    """Create `folder` (mode 0700) if missing; take the group/other write bits off one we own (a
    Kubernetes emptyDir is 0777); raise PermissionError if it is still not private."""
    uid = os.getuid() if uid is None else uid
    try:
        os.makedirs(folder, mode=0o700)
    except FileExistsError:
        pass
    if shared_folder_declared():
        return  # a pod-shared volume: its mode is the pod's (fsGroup), not ours to tighten
    try:
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(folder, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH | stat.S_ISVTX))
    except OSError:
        pass
    reason = check_private_folder(folder, uid)
    if reason is not None:
        raise PermissionError(f"refusing the socket folder: {reason}")


def host_header_allowed(host: str, port: int, bound_host: str) -> bool:
    """Whether an HTTP `Host` header may reach a server bound to `bound_host`:`port`: it must name that
    port and be an IP literal, `localhost`, or the bound name. A DNS-rebinding page always sends a DNS
    name of its own, so a loopback server that checks this cannot be read by a web page."""
    name, sep, got_port = host.strip().lower().rpartition(":")
    if not sep or got_port != str(port) or (name.count(":") and not name.startswith("[")):
        return False
    name = name.strip("[]")
    if name in ("localhost", bound_host.lower()):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
