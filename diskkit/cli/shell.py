"""What both command lines (diskkit and launcher) share: registry flags, platform parsing, error exits."""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import json
import signal
import sys

import click

from diskkit import interrupts
from diskkit.errors import DiskkitError, Exit
from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions


class LazyGroup(click.Group):
    """A group whose subcommands in other modules load when named (`lazy`: name -> "module:attr"):
    a run imports what its own command needs, not what every other command boots with."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in self.lazy:
            module, attr = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


def registry_options(command):
    """--tls-verify, --cert-dir, --authfile and --creds after the command name, as skopeo takes them.

    The command receives them folded into one `registry: RegistryOptions` argument.
    """

    @functools.wraps(command)
    def wrapper(*args, tls_verify, cert_dir, authfile, creds, retry_times, retry_delay, **kwargs):
        registry = RegistryOptions(tls_verify=tls_verify, cert_dir=cert_dir, authfile=authfile, creds=creds, retries=retry_times, backoff=retry_delay)
        return command(*args, registry=registry, **kwargs)

    options = [
        click.option("--creds", metavar="USER:PASS", help="Registry credentials (else the auth file is used)."),
        click.option("--authfile", type=click.Path(dir_okay=False), help="Auth file (default: $REGISTRY_AUTH_FILE, else ${XDG_RUNTIME_DIR}/containers/auth.json or /run/containers/$UID/auth.json, then ~/.config/containers/auth.json, ~/.docker/config.json, ~/.dockercfg)."),
        click.option("--cert-dir", type=click.Path(file_okay=False), help="Directory of *.crt CAs and *.cert/*.key client certificates for the registry."),
        click.option("--retry-times", type=click.IntRange(0, 20), default=5, show_default=True, help="Retries on connection errors, 408, 429 and 5xx."),
        click.option("--retry-delay", type=click.FloatRange(0, 60), default=0.5, show_default=True, metavar="SECONDS", help="First backoff delay; doubles per retry, with jitter (Retry-After wins)."),
        click.option("--tls-verify", type=click.BOOL, default=None, metavar="BOOL",
                     help="Require HTTPS and verify certificates (--tls-verify=false also allows plain HTTP). Unset: true, unless registries.conf marks the registry insecure; given: wins over registries.conf."),
    ]
    for option in options:
        wrapper = option(wrapper)
    return wrapper


# skopeo's boolean flags that take an optional value (pflag's NoOptDefVal): bare, they mean true and
# never take the next argument as their value, so `--tls-verify SRC DEST` keeps SRC a positional.
OPTIONAL_BOOLS = ("--tls-verify", "--src-tls-verify", "--dest-tls-verify")


def skopeo_args(args: list[str]) -> list[str]:
    """The command line with each bare optional boolean spelled out as `=true` (up to a `--`)."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        out.append(f"{arg}=true" if arg in OPTIONAL_BOOLS else arg)
    return out


def platform(value: str | None) -> Platform | None:
    return Platform.parse(value) if value else None


def _keep_large_buffers() -> None:
    """Serve the 1 MiB chunks of the streaming pipelines from the heap instead of fresh mmaps.

    glibc maps every allocation over its threshold and unmaps it on free, so each chunk costs
    256 page faults; with this the same memory is reused (a third of the CPU time of a pull).
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: its allocator decides


def refuse_repeats(command: click.Command, args: list[str], parent: click.Context | None = None) -> None:
    """Refuse an option that takes one value given more than once, on every command of both CLIs.

    click (like pflag) keeps the last value, so `-t A -t B` silently drops A; options meant to be
    repeated are declared `multiple` and pass. Parse errors are left to the real parse, which reports them.
    """
    ctx = click.Context(command, parent=parent, info_name=command.name, resilient_parsing=True)
    try:
        _, rest, order = command.make_parser(ctx).parse_args(list(args))
    except click.UsageError:
        return
    seen: set[str] = set()
    for param in order:
        if not isinstance(param, click.Option) or param.multiple or param.count or param.is_flag:
            continue
        if param.name in seen:
            name = max(param.opts, key=len)
            error = DiskkitError(name, f"given more than once; it takes one value (the last one would silently win){_REPEAT_HINTS.get(name, '')}")
            error.exit_code = 2  # a usage error, as click's own
            raise error
        seen.add(param.name)
    if isinstance(command, click.Group) and rest:
        sub = command.get_command(ctx, rest[0])
        if sub is not None:
            refuse_repeats(sub, rest[1:], ctx)


_REPEAT_HINTS = {
    # virtctl has no such flag; waiting for texts in order is an expect script's job, so one text: the last one the guest prints.
    "--wait-for": "; give the text the guest prints last",
}


EXIT_EPILOG = "\b\nExit statuses (both commands; --json failures print {\"error\": {...}}):\n  " + ", ".join(
    f"{int(code)} {code.name.lower()}" for code in Exit) + "."


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON output (a --json before any `--`)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _fail(prog: str, as_json: bool, line: str, error: dict) -> None:
    """A failure's one line on stderr and, with --json, {"error": {...}} on stdout: the one JSON
    object the command prints."""
    click.echo(f"{prog}: {line}", err=True)
    if as_json:
        click.echo(json.dumps({"error": error}, indent=2))


def _plain_error(message: str, code: int) -> dict:
    try:
        kind = Exit(code).name.lower()
    except ValueError:
        kind = "failed"
    return {"message": message, "kind": kind, "exitCode": code, "retryable": False}


def run_main(cli: click.Group, prog: str) -> None:
    """Run a click group with one-line errors (`prog: subject: rule`) and the exit codes of
    diskkit.errors.Exit; with --json a failure is also one JSON object on stdout."""
    _keep_large_buffers()
    # SIGTERM unwinds like Ctrl-C, so every `finally` runs: staging files go, VMs are destroyed.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupts.unwind)
    run_command(cli, prog, skopeo_args(sys.argv[1:]))
    # Everything still alive is freed by exit anyway: frozen, the interpreter's last collections
    # skip scanning it, 20-25 ms of every command's exit (measured with the registry client loaded).
    gc.freeze()


def run_command(cli: click.Group, prog: str, args: list[str]) -> None:
    """One command line, its failure told as run_main tells it (SystemExit with its exit status);
    what a test runs in its own process when the command must see state only that process holds."""
    as_json = wants_json(args)
    try:
        refuse_repeats(cli, args)
        cli.main(args=args, prog_name=prog, standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _fail(prog, as_json, "interrupted", _plain_error("interrupted", Exit.INTERRUPTED))
        sys.exit(Exit.INTERRUPTED)
    except click.ClickException as exc:
        if as_json:
            click.echo(json.dumps({"error": _plain_error(exc.format_message(), exc.exit_code)}, indent=2))
        exc.show()
        sys.exit(exc.exit_code)
    except DiskkitError as exc:
        _fail(prog, as_json, exc.line(), exc.to_json())
        sys.exit(exc.exit_code)
    except Exception as exc:
        # A bug, not a refusal: the traceback follows on stderr; a script still gets its one object.
        if as_json:
            click.echo(json.dumps({"error": _plain_error(" ".join(f"{exc.__class__.__name__}: {exc}".split()), Exit.FAILED)}, indent=2))
        raise
