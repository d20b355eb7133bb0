"""Write the reference pages that are generated from the code, so they say what the code does:
docs/cli.md from the click commands' own `--help`, and the field table of docs/kubevirt.md from the
launcher's field coverage (launcher.spec.coverage).

`python scripts/generated_docs.py` rewrites both; tests/test_generated_docs.py fails when either is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLI_PAGE = REPO / "docs" / "cli.md"
KUBEVIRT_PAGE = REPO / "docs" / "kubevirt.md"
WIDTH = 100  # the groups' own max_content_width, fixed so the page does not depend on the terminal
FIELDS = re.compile(r"(<!-- fields -->\n).*?(<!-- /fields -->)", re.S)

CLI_HEADER = """# CLI reference

Generated from the commands' own `--help` by `scripts/generated_docs.py`; the test suite fails when
this page and the code disagree. The guides explain when to use what: [build.md](build.md),
[local-vms.md](local-vms.md).
"""
MEANING = {
    "handled": "rendered as KubeVirt renders it",
    "inert": "accepted; changes nothing the guest sees",
    "unsupported": "refused in one line (`--ignore-unsupported` drops it, naming it)",
    "unsupported unless false": "accepted when false; refused when true",
    "node lacks": "refused as a cluster stops a VM its nodes cannot serve, in the words of what stops it (no device plugin, DRA driver or CNI plugin here, an empty `permittedHostDevices`)",
    "judged": "refused in one line saying why where it asks what the launcher cannot do (in KubeVirt's words where KubeVirt refuses it too); else accepted",
}


def _sections(prog: str, command: click.Command, parent: click.Context | None = None):
    ctx = click.Context(command, info_name=prog, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    yield ctx.command_path, command.get_help(ctx)
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _sections(name, sub, ctx)


def cli_page() -> str:
    from diskkit.cli.commands import cli as diskkit_cli
    from launcher.cli.commands import cli as launcher_cli

    out = [CLI_HEADER]
    for prog, group in (("diskkit", diskkit_cli), ("launcher", launcher_cli)):
        out.append(f"\n## {prog}\n")
        for path, text in _sections(prog, group):
            if " " in path:
                out.append(f"\n### `{path}`\n")
            out.append(f"\n```text\n{text.rstrip()}\n```\n")
    out.append(exit_table())
    return "".join(out)


def exit_table() -> str:
    from diskkit.errors import EXIT_MEANINGS

    rows = ["\n## Exit statuses (both commands)\n",
            "With `--json`, a failure prints one object on stdout, besides its one line on stderr:",
            '`{"error": {"message", "kind", "exitCode", "retryable"}}`, with `"httpStatus"` and `"registryCode"`',
            "(the distribution API's error code) when a registry answered.\n",
            "| status | kind | meaning |", "|---|---|---|"]
    rows += [f"| {int(code)} | `{code.name.lower()}` | {meaning} |" for code, meaning in EXIT_MEANINGS.items()]
    return "\n".join(rows) + "\n"


def _fields(shape, prefix: str):
    from launcher.spec.coverage import ListOf

    if isinstance(shape, ListOf):
        yield from _fields(shape.shape, prefix + "[]")
    elif isinstance(shape, dict):
        if not shape:
            yield prefix, "handled"
        for name, sub in shape.items():
            yield from _fields(sub, f"{prefix}.{name}" if prefix else name)
    else:
        yield prefix, shape


def field_table() -> str:
    from launcher.spec.coverage import VM_SPEC

    rows = ["| field (VirtualMachine `spec.`; a VMI's spec is `template.spec`) | the launcher |", "|---|---|"]
    rows += [f"| `{path}` | {MEANING[status]} |" for path, status in _fields(VM_SPEC, "")]
    return "\n".join(rows) + "\n"


def kubevirt_page() -> str:
    text = KUBEVIRT_PAGE.read_text()
    if not FIELDS.search(text):
        raise SystemExit(f"{KUBEVIRT_PAGE}: no <!-- fields --> ... <!-- /fields --> markers")
    return FIELDS.sub(lambda m: m.group(1) + field_table() + m.group(2), text)


if __name__ == "__main__":
    CLI_PAGE.write_text(cli_page())
    KUBEVIRT_PAGE.write_text(kubevirt_page())
    print(f"wrote {CLI_PAGE.relative_to(REPO)} and {KUBEVIRT_PAGE.relative_to(REPO)}")
