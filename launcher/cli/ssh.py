"""`launcher ssh`: the system ssh to a VM the launcher runs, through `launcher port-forward --stdio`
as its ProxyCommand (virtctl ssh --local-ssh, pkg/virtctl/ssh/ssh.go). Target parsing and the ssh
command line are pure; the command checks the VM exists, waits for its ssh server and settles its host
keys on first contact (launcher.runtime.sshreach), then becomes ssh (its exit status is the remote
command's, or 255 for ssh's own failures)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

import click

from diskkit.errors import DiskkitError
from launcher.node.selfexec import launcher_argv

# pkg/virtctl/portforward/portforward.go normalizeKind: both name the VM the launcher runs as its VMI.
KINDS = {"vm": ("vm", "vms", "virtualmachine", "virtualmachines"),
         "vmi": ("vmi", "vmis", "virtualmachineinstance", "virtualmachineinstances")}


@dataclass(frozen=True)
class Target:
    kind: str
    name: str
    namespace: str | None = None
    user: str | None = None

    @property
    def vm(self) -> str:
        """The name `launcher stop`/`status` take."""
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    @property
    def forward(self) -> str:
        """The target as port-forward takes it, virtctl's KIND/NAME[/NAMESPACE]."""
        return f"{self.kind}/{self.name}" + (f"/{self.namespace}" if self.namespace else "")

    @property
    def host(self) -> str:
        """The host name ssh sees (and known_hosts keys on): KIND.NAME.NAMESPACE, as virtctl writes it."""
        return f"{self.kind}.{self.name}.{self.namespace or 'default'}"


def parse_target(arg: str) -> Target:
    """[USER@](KIND/NAME[/NAMESPACE] | NAME), in virtctl's words (pkg/virtctl/ssh ParseTarget,
    portforward ParseTarget); a bare NAME is a VMI's, as `launcher port-forward` takes it."""
    user = None
    if "@" in arg:
        user, arg = arg.split("@", 1)[0], arg.split("@")[1]
        if not user:
            raise DiskkitError("target", "expected username before '@'")
        if not arg:
            raise DiskkitError("target", "expected target after '@'")
    if not arg:
        raise DiskkitError("target", "target cannot be empty")
    parts = arg.split("/")
    if len(parts) == 1:
        parts = ["vmi", *parts]
    if len(parts) > 3:
        raise DiskkitError("target", "target is not valid with more than two '/'")
    kind = next((k for k, names in KINDS.items() if parts[0].lower() in names), None)
    if kind is None:
        raise DiskkitError("target", f"unsupported resource type '{parts[0]}'")
    if len(parts) == 3 and not parts[2]:
        raise DiskkitError("target", "namespace cannot be empty")
    if not parts[1]:
        raise DiskkitError("target", "name cannot be empty")
    return Target(kind, parts[1], parts[2] if len(parts) == 3 else None, user)


def default_user() -> str | None:
    """virtctl's DefaultUsername: $USER, $USERNAME, $LOGNAME."""
    return next((os.environ[v] for v in ("USER", "USERNAME", "LOGNAME") if os.environ.get(v)), None)


def proxy_command(target: Target, port: int, launcher: list[str], cache_dir: str | None = None) -> str:
    """ssh's ProxyCommand: this launcher (by absolute path, so ssh may run it from anywhere) forwarding
    one connection over stdin/stdout. ssh expands %-tokens in it, so a literal % is doubled."""
    args = [*launcher, "port-forward", "--stdio", target.forward, str(port)]
    if cache_dir:
        args += ["--cache-dir", os.path.abspath(cache_dir)]
    return shlex.join(args).replace("%", "%%")


def ssh_command(target: Target, port: int, launcher: list[str], *, identity: str | None = None, user: str | None = None,
                local_opts: tuple[str, ...] = (), host_key_opts: tuple[str, ...] = (), command: tuple[str, ...] = (),
                cache_dir: str | None = None) -> list[str]:
    """The ssh command line, in virtctl's order (LocalClientCmd): ProxyCommand, --local-ssh-opts, -i, the
    target, the command; the VM's host key options right after the user's, which win (ssh keeps an
    option's first value). The user: USER@ in the target, else -l, else $USER."""
    args = ["ssh", "-o", f"ProxyCommand={proxy_command(target, port, launcher, cache_dir)}"]
    for opt in local_opts:
        args += shlex.split(opt)
    args += host_key_opts
    if identity:
        args += ["-i", identity]
    login = target.user or user
    args.append(f"{login}@{target.host}" if login else target.host)
    return args + list(command)


@click.command("ssh", epilog="""\b
Examples:
  launcher ssh root@vmi/testvm                       # a shell, with ~/.ssh's keys or the agent's
  launcher ssh -i ~/.ssh/id_ed25519 root@vmi/testvm -- uname -a
  launcher ssh -l fedora -c 'sudo dmesg' vm/web/prod # NAMESPACE after the name, as virtctl
  launcher ssh -t "-o ServerAliveInterval=10" debian@testvm -c true
""")
@click.argument("target")
@click.argument("remote", nargs=-1, type=click.UNPROCESSED)
@click.option("-i", "--identity-file", metavar="FILE", help="The private key (default: ssh's own, or the agent's).")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=22, show_default=True, help="The guest's ssh port.")
@click.option("-l", "--username", metavar="USER", help="Log in as USER (default: USER@ in the target, else $USER, as virtctl).")
@click.option("-c", "--command", metavar="COMMAND", help="Run COMMAND in the guest (or give it after --).")
@click.option("-t", "--local-ssh-opts", "local_opts", multiple=True, metavar="OPTS", help="More options for the local ssh, e.g. \"-o ServerAliveInterval=10\"; repeatable.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300, show_default=True, metavar="SECONDS",
              help="On first contact, how long to wait for the guest's ssh server (and the host keys cloud-init prints).")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="The node cache the VM was started from.")
def ssh(target, remote, identity_file, port, username, command, local_opts, timeout, cache_dir) -> None:
    """Open an ssh connection to a VM started by `launcher run` ([USER@]vmi/NAME[/NAMESPACE] or NAME).

    Runs the system ssh with `launcher port-forward --stdio` as its ProxyCommand, as `virtctl ssh
    --local-ssh` does; exits with the remote command's status (255: ssh itself failed).

    No host key options are needed: the first contact waits until the guest's ssh server answers and
    trusts the host keys cloud-init printed on the VM's console at first boot, else the first key the
    server shows (said in one line); both are kept for this VM alone, in its run directory, and a
    changed key is refused.
    """
    from launcher.cli.options import node_cache, say
    from launcher.runtime.sshreach import first_contact
    from launcher.runtime.lookup import record_of

    if command and remote:
        raise DiskkitError("ssh", "give the command with -c or after --, not both")
    parsed = parse_target(target)
    cache = node_cache(cache_dir)
    record_of(cache, parsed.vm)
    contact = first_contact(cache, parsed.vm, port, timeout, say, progress=say)
    argv = ssh_command(parsed, port, launcher_argv(), identity=identity_file, user=username or default_user(),
                       local_opts=local_opts, host_key_opts=contact.ssh_options(), command=(command,) if command else remote,
                       cache_dir=cache_dir)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
