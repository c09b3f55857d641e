"""The rehearsal's "VM": a real OpenSSH server on 127.0.0.1, in a PID namespace of its own.

``ray up`` reaches a node over SSH; in the rehearsal that node is this
machine. :class:`LoopbackSSHD` starts Debian's ``/usr/sbin/sshd`` on a free
loopback port with its own host key and config in a temporary folder (never
the system's sshd or port 22), and:

- takes the keys Compute Engine would install: :meth:`authorize` writes the
  ``ssh-keys`` of the project's metadata (where Ray's ``bootstrap_gcp`` puts
  its key) for the SSH user to the file ``AuthorizedKeysFile`` names, as the
  guest agent of a real VM does;
- gives every session the VM's environment (``SetEnv``): a scratch HOME, the
  folder of the rehearsal's ``sitecustomize`` on PYTHONPATH, and RAY_TMPDIR so
  the rehearsal's Ray keeps its sessions and ``ray_current_cluster`` out of
  /tmp/ray;
- runs in a new PID namespace (``unshare --pid --mount-proc``): the ``ray
  stop`` that the head's start commands and ``ray down`` run can only see, and
  stop, the Ray this rehearsal started; and when the server stops, the kernel
  ends every process left in that namespace.

Ray's SSH runner always dials port 22 (``SSHOptions`` takes no port); the
cluster file's ``auth.ssh_proxy_command`` is its way to another one:
:attr:`LoopbackSSHD.proxy_command` is a small Python relay to this server's port.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

from launcher.errors import UserError

SSHD = "/usr/sbin/sshd"
SSH_CONFIG = "/etc/ssh/ssh_config"
INSTALL = "sudo apt-get install -y openssh-server rsync (Debian/Ubuntu)"

# Copies the SSH client's stdin to the server's port and the port's answers to stdout (ssh's ProxyCommand).
RELAY = '''\
import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(data)
threading.Thread(target=up, daemon=True).start()
out = sys.stdout.buffer
while True:
    data = s.recv(65536)
    if not data:
        break
    out.write(data)
    out.flush()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_tools() -> list[str]:
    """What the rehearsal's SSH needs and this machine lacks (sshd, ssh, rsync, unshare)."""
    tools = {"sshd": os.path.exists(SSHD)}
    tools.update({name: shutil.which(name) is not None for name in ("ssh", "ssh-keygen", "rsync", "unshare")})
    missing = [name for name, found in tools.items() if not found]
    if "unshare" not in missing and not _pid_namespace():
        missing.append("a PID namespace (unshare --pid: root, or CAP_SYS_ADMIN)")
    return missing


def _pid_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class LoopbackSSHD:
    """An sshd on a free 127.0.0.1 port; files under ``folder``; sessions get ``env``.

    Args:
        folder: where the host key, config, authorized keys and log go (the caller removes it).
        env: variables every session gets (HOME first: the VM's home).
    """

    def __init__(self, folder: str, env: dict[str, str], ip: str = "127.0.0.1", port: int | None = None,
                 identity: str | None = None) -> None:
        self.folder, self.env, self.ip = folder, dict(env), ip  # ip: the VM's address in the local API
        # A key file every SSH client in the sessions offers (see _ssh_config)
        self.identity = identity
        self.user = getpass.getuser()
        self.port = port or free_port()
        self.keys_file = os.path.join(folder, "authorized_keys")
        self.log = os.path.join(folder, "sshd.log")
        self.relay = os.path.join(folder, "relay.py")
        self._proc: subprocess.Popen | None = None

    @property
    def proxy_command(self) -> str:
        """The ProxyCommand (the cluster file's ``auth.ssh_proxy_command``) that reaches this server."""
        return f"{sys.executable} -I -S {self.relay} {self.port}"

    def start(self, timeout_s: float = 20) -> "LoopbackSSHD":
        missing = missing_tools()
        if missing:
            raise UserError(f"the `ray up` rehearsal needs {', '.join(missing)} on this machine", f"install: {INSTALL}")
        os.makedirs(self.folder, exist_ok=True)
        with open(self.relay, "w", encoding="utf-8") as f:
            f.write(RELAY)
        open(self.keys_file, "a").close()
        host_key = os.path.join(self.folder, "host_ed25519")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key], check=True,
                       stdout=subprocess.DEVNULL)
        config = os.path.join(self.folder, "sshd_config")
        with open(config, "w", encoding="utf-8") as f:
            f.write(self._config(host_key))
        if os.geteuid() == 0:  # a root sshd's privilege separation needs it (the package's service makes it)
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        check = subprocess.run([SSHD, "-t", "-f", config], capture_output=True, text=True)
        if check.returncode:
            raise UserError(f"sshd refuses the rehearsal's config: {check.stderr.strip()}", f"install: {INSTALL}")
        # --kill-child: if this process dies, the namespace's first process (sshd) gets SIGKILL, and with it
        # every process in the namespace.
        command = [SSHD, "-D", "-e", "-f", config]
        if self.identity:
            command = ["sh", "-c", f"mount --bind {self._ssh_config()} {SSH_CONFIG} && exec {shlex.join(command)}"]
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *command],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._wait_listening(timeout_s)
        self._check_isolated()
        return self

    def _ssh_config(self) -> str:
        """The SSH clients' system-wide config as the sessions see it (bind-mounted in sshd's own mount
        namespace, so nothing else on this machine sees it): the real one, and ``identity`` offered to every
        host. Ray's SSH runner on a head passes ``-i ~/ray_bootstrap_key.pem``, and ssh expands that ``~`` to
        the user's home in the password database, not to the VM's HOME, where the key is."""
        try:
            with open(SSH_CONFIG, encoding="utf-8") as f:
                system = f.read()
        except OSError:
            system = ""
        path = os.path.join(self.folder, "ssh_config")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# the ray up rehearsal's VM: the key Ray put in the VM's home\n"
                    f"Host *\n    IdentityFile {self.identity}\n\n{system}")
        return path

    def _check_isolated(self) -> None:
        """sshd (so every session) runs in a PID namespace other than this process's: a `ray stop` there
        cannot see another Ray on this machine."""
        children = f"/proc/{self._proc.pid}/task/{self._proc.pid}/children"
        try:
            with open(children, encoding="ascii") as f:
                child = f.read().split()[0]
            isolated = os.readlink(f"/proc/{child}/ns/pid") != os.readlink("/proc/self/ns/pid")
        except (OSError, IndexError):
            isolated = False
        if not isolated:
            self.stop()
            raise UserError("the rehearsal's sshd is not in a PID namespace of its own, so `ray stop` on the "
                            "head could stop other Ray instances here", "run it as root (unshare --pid)")

    def _config(self, host_key: str) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return "\n".join([
            f"Port {self.port}", f"ListenAddress {self.ip}", f"HostKey {host_key}",
            f"PidFile {os.path.join(self.folder, 'sshd.pid')}", f"AuthorizedKeysFile {self.keys_file}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password", f"AllowUsers {self.user}",
            f"SetEnv {env}", "PrintMotd no", "PrintLastLog no", "MaxStartups 50:30:100", "MaxSessions 50",
            "Subsystem sftp internal-sftp", ""])

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise UserError(f"sshd stopped at once: {self.log_tail()}", f"install: {INSTALL}")
            try:
                with socket.create_connection((self.ip, self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.1)
        raise UserError(f"sshd did not answer on {self.ip}:{self.port} in {timeout_s:.0f} s: {self.log_tail()}",
                        f"install: {INSTALL}")

    def authorize(self, metadata_items: list[dict]) -> int:
        """Write the project metadata's ``ssh-keys`` for this server's user; returns how many."""
        keys = authorized_keys(metadata_items, self.user)
        with open(self.keys_file + ".new", "w", encoding="utf-8") as f:
            f.write("".join(k + "\n" for k in keys))
        os.replace(self.keys_file + ".new", self.keys_file)
        return len(keys)

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop sshd; the kernel ends whatever is left in its PID namespace with it."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            # unshare waits for its child and ignores SIGTERM; SIGKILL makes --kill-child end the namespace.
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=30)
        self._proc = None

    def __enter__(self) -> "LoopbackSSHD":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def authorized_keys(metadata_items: list[dict], user: str) -> list[str]:
    """The keys of ``user`` in Compute Engine's ``ssh-keys`` metadata (lines ``USER:TYPE KEY COMMENT``)."""
    value = next((i.get("value", "") for i in metadata_items if i.get("key") == "ssh-keys"), "") or ""
    keys = []
    for line in value.splitlines():
        who, _, key = line.strip().partition(":")
        if who == user and key:
            keys.append(key)
    return keys
