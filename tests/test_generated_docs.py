"""The reference pages generated from the code say what the code does: docs/cli.md is the commands'
own --help, and docs/kubevirt.md's field table is launcher.spec.coverage. A command, option, help text
or field changed without regenerating them (python scripts/generated_docs.py) fails here."""

import importlib.util
from pathlib import Path

from diskkit.cli.commands import cli as diskkit_cli
from launcher.cli.commands import cli as launcher_cli

REPO = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generated_docs", REPO / "scripts" / "generated_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    generator = _generator()
    assert generator.CLI_PAGE.read_text() == generator.cli_page(), "docs/cli.md is stale: run python scripts/generated_docs.py"


def test_cli_reference_covers_every_command():
    text = (REPO / "docs" / "cli.md").read_text()
    for prog, group in (("diskkit", diskkit_cli), ("launcher", launcher_cli)):
        for name in group.commands:
            assert f"### `{prog} {name}`" in text, f"{prog} {name} missing from docs/cli.md"


def test_kubevirt_field_table_is_current():
    generator = _generator()
    assert generator.KUBEVIRT_PAGE.read_text() == generator.kubevirt_page(), "docs/kubevirt.md is stale: run python scripts/generated_docs.py"


def test_field_table_names_refused_and_inert_fields():
    text = (REPO / "docs" / "kubevirt.md").read_text()
    assert "| `template.spec.domain.devices.watchdog` | refused in one line" in text
    assert "| `template.spec.domain.devices.gpus` | refused as a cluster stops a VM its nodes cannot serve" in text
    assert "| `template.spec.nodeSelector` | accepted; changes nothing the guest sees |" in text
