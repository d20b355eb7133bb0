"""`launcher port-forward` arguments as virtctl takes them (pkg/virtctl/portforward/portforward.go
ParseTarget and normalizeKind, ports.go parsePort), plus a bare NAME; pure."""

from __future__ import annotations

import pytest

from diskkit.errors import DiskkitError
from launcher.network.forward import Forward, parse_port, parse_target


@pytest.mark.parametrize("text,name", [
    ("vmi/testvm", "testvm"), ("vm/testvm", "testvm"), ("VirtualMachineInstance/testvm", "testvm"),
    ("vmis/testvm", "testvm"), ("vmi/testvm/ns", "ns/testvm"), ("testvm", "testvm"),
])
def test_targets(text, name):
    assert parse_target(text) == name


@pytest.mark.parametrize("text,words", [
    ("", "target cannot be empty"), ("vmi/", "name cannot be empty"), ("vmi/x/", "namespace cannot be empty"),
    ("pod/x", "unsupported resource type 'pod'"), ("vmi/a/b/c", "target is not valid with more than two '/'"),
])
def test_target_refusals(text, words):
    with pytest.raises(DiskkitError, match=words):
        parse_target(text)


@pytest.mark.parametrize("text,forward", [
    ("8080", Forward("tcp", 8080, 8080)), ("8080:80", Forward("tcp", 8080, 80)), ("udp/5353:53", Forward("udp", 5353, 53)),
    ("tcp/2222:22", Forward("tcp", 2222, 22)), ("0:22", Forward("tcp", 0, 22)),
])
def test_ports(text, forward):
    assert parse_port(text) == forward


@pytest.mark.parametrize("text", ["sctp/80", ":", "x:80", "80:0", "70000:80", "1:2:3"])
def test_port_refusals(text):
    with pytest.raises(DiskkitError):
        parse_port(text)
