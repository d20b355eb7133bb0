"""Manifest files and object metadata as the Kubernetes API server takes them (pure, but for
`read_manifest`): a bounded read, YAML without runaway alias expansion, names, namespaces, labels
and annotations checked as apimachinery's ValidateObjectMeta does, and no string that XML 1.0 (the
domain XML) cannot carry.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from launcher.spec.fields import DNS1123_SUBDOMAIN, SUBDOMAIN_MESSAGE, SpecError, check_dns_label

# k8s.io/apiserver/pkg/server/config.go: MaxRequestBodyBytes, the largest object the API server decodes.
MAX_MANIFEST_BYTES = 3 * 1024 * 1024
# k8s.io/apimachinery/pkg/api/validation/objectmeta.go: TotalAnnotationSizeLimitB
TOTAL_ANNOTATION_SIZE = 256 * 1024
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_MAX = 63

# k8s.io/apimachinery/pkg/util/validation/validation.go, its regular expressions and messages.
_QUALIFIED = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUALIFIED_EXAMPLES = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric"
                       " character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is"
                       " '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
LABEL_VALUE_MESSAGE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must"
                       " start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex"
                       " used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")

# XML 1.0's Char production: libvirt cannot parse a domain holding anything else (NUL, most C0 controls,
# lone surrogates, U+FFFE/U+FFFF).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

# gopkg.in/yaml (decode.go, which sigs.k8s.io/yaml and so kubectl and the API server use): past a
# thousand decoded nodes, the share of them reached through an alias may be at most 99 %, falling to
# 10 % between 400,000 and 4,000,000 nodes. A "billion laughs" document trips it after a few thousand.
_ALIAS_RATIO_LOW, _ALIAS_RATIO_HIGH = 400_000, 4_000_000


# libvirt names files after a domain (<name>.xml.new, <name>.pid, <name>.log) and fails with
# ENAMETOOLONG past NAME_MAX (255 bytes): `<namespace>_<name>` may reach 317.
LIBVIRT_NAME_MAX = 255 - len(".xml.new")


def domain_name(namespace: str, name: str) -> str:
    """KubeVirt's libvirt domain name, `<namespace>_<name>` (pkg/virt-launcher/virtwrap/util:
    VMINamespaceKeyFunc), whenever libvirt can hold it; past that (KubeVirt cannot start such a VMI
    either), its head and a hash of the whole."""
    full = f"{namespace}_{name}"
    if len(full.encode()) <= LIBVIRT_NAME_MAX:
        return full
    return f"{full[:LIBVIRT_NAME_MAX - 17]}-{hashlib.sha256(full.encode()).hexdigest()[:16]}"


def _quoted(value: str) -> str:
    return json.dumps(value)  # Go's %q, near enough: one line whatever the value holds


# ---------------------------------------------------------------- files

STDIN = "-"  # as `kubectl apply -f -`


def shown_path(path: str | Path) -> str:
    return "stdin" if str(path) == STDIN else str(path)


def read_manifest(path: str | Path) -> str:
    """The text of a manifest file, or of stdin for `-`: at most MAX_MANIFEST_BYTES, UTF-8."""
    try:
        if str(path) == STDIN:
            data = sys.stdin.buffer.read(MAX_MANIFEST_BYTES + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as err:
        raise SpecError(shown_path(path), err.strerror or str(err)) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise SpecError(shown_path(path), f"is larger than {MAX_MANIFEST_BYTES} bytes (3 MiB), the most the Kubernetes API server accepts")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(shown_path(path), f"is not UTF-8 text (byte {err.start}: {err.reason})") from None


def _allowed_alias_ratio(decodes: int) -> float:
    if decodes <= _ALIAS_RATIO_LOW:
        return 0.99
    if decodes >= _ALIAS_RATIO_HIGH:
        return 0.10
    return 0.99 - 0.89 * (decodes - _ALIAS_RATIO_LOW) / (_ALIAS_RATIO_HIGH - _ALIAS_RATIO_LOW)


def check_aliasing(root: yaml.Node) -> None:
    """Walk the composed document as decoding it would (aliases expanded), refusing what go-yaml
    refuses before the expansion can grow: excessive aliasing and an anchor that contains itself.
    PyYAML shares the objects of aliased nodes, so the danger is in whoever walks them later."""
    import yaml

    decodes = aliases = 0
    seen: set[int] = set()
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool, bool]] = [(root, False, False)]  # node, through an alias, leaving it
    while stack:
        node, aliased, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            continue
        if id(node) in on_path:
            raise yaml.YAMLError(f"anchor {node.start_mark.line + 1}:{node.start_mark.column + 1} value contains itself")
        aliased = aliased or id(node) in seen
        seen.add(id(node))
        decodes += 1
        aliases += aliased
        if aliases > 100 and decodes > 1000 and aliases / decodes > _allowed_alias_ratio(decodes):
            raise yaml.YAMLError("document contains excessive aliasing")
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            continue
        on_path.add(id(node))
        stack.append((node, aliased, True))
        stack.extend((child, aliased, False) for child in reversed(children))


def parse_yaml(text: str, origin: str | Path) -> list[Any]:
    """Every document of a YAML stream, safe-loaded, each checked by `check_aliasing` first."""
    import yaml  # here, not for every command: only those reading a manifest pay for the parser

    loader = yaml.SafeLoader(text)
    loader.name = str(origin)  # marks in messages name the file rather than "<unicode string>"
    docs = []
    try:
        while loader.check_node():
            node = loader.get_node()
            check_aliasing(node)
            docs.append(loader.construct_document(node))
    except yaml.YAMLError as err:
        raise SpecError(str(origin), f"not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise SpecError(str(origin), "not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()
    return docs


def parse_json(text: str, origin: str | Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(str(origin), f"not valid JSON: {err}") from None
    except RecursionError:
        raise SpecError(str(origin), "not valid JSON: nested too deeply") from None


def load_documents(path: str | Path) -> list[Any]:
    """The documents of a .json file (one) or a YAML file or stdin (any number; JSON is YAML), read within the limits."""
    text = read_manifest(path)
    return [parse_json(text, path)] if str(path).endswith(".json") else parse_yaml(text, shown_path(path))


# ---------------------------------------------------------------- strings

def check_xml_text(doc: Any, at: str, skip: frozenset[str] = frozenset()) -> None:
    """Refuse any key or string value holding a character XML 1.0 cannot carry, naming its field.
    Keys in `skip` hold file contents that never reach the domain XML or a file name."""
    # Each value carries its trail (parent's trail, key, whether an index); the field's name is spelled
    # out only for a refusal, which is rare: most specs are walked thousands of nodes deep for none.
    stack: list[tuple[Any, tuple | None]] = [(doc, None)]
    while stack:
        value, trail = stack.pop()
        if isinstance(value, str):
            bad = _NOT_XML.search(value)
            if bad:
                raise SpecError(_field(at, trail), f"must not contain the character U+{ord(bad.group()):04X} (XML 1.0 cannot carry it)")
        elif isinstance(value, dict):
            for key, item in value.items():
                child = (trail, key, False)
                if isinstance(key, str):
                    stack.append((key, child))
                if key not in skip:
                    stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, (trail, i, True)) for i, item in enumerate(value))


def _field(at: str, trail: tuple | None) -> str:
    steps = []
    while trail is not None:
        trail, key, index = trail
        steps.append((key, index))
    where = at
    for key, index in reversed(steps):
        where = f"{where}[{key}]" if index else f"{where}.{key}" if where else str(key)
    return where


# ---------------------------------------------------------------- metadata

def check_subdomain(name: str, at: str) -> None:
    """validation.IsDNS1123Subdomain: object names (VMIs, VMs, DataVolumes, claims, secrets...)."""
    if len(name) > DNS1123_SUBDOMAIN_MAX:
        raise SpecError(at, f"Invalid value: {_quoted(name[:DNS1123_SUBDOMAIN_MAX + 1])}...: must be no more than 253 characters")
    if not DNS1123_SUBDOMAIN.fullmatch(name):
        raise SpecError(at, f"Invalid value: {_quoted(name)}: {SUBDOMAIN_MESSAGE}")


def check_namespace(namespace: str, at: str) -> None:
    """ValidateNamespaceName: a DNS-1123 label, at most 63 characters."""
    check_dns_label(namespace, at)


def _qualified_name(key: str, at: str) -> None:
    """validation.IsQualifiedName: [prefix/]name, the prefix a DNS subdomain."""
    parts = key.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            raise SpecError(at, f"Invalid value: {_quoted(key)}: prefix part must be non-empty")
        if len(prefix) > DNS1123_SUBDOMAIN_MAX:
            raise SpecError(at, f"Invalid value: {_quoted(key)}: prefix part must be no more than 253 characters")
        if not DNS1123_SUBDOMAIN.fullmatch(prefix):
            raise SpecError(at, f"Invalid value: {_quoted(key)}: prefix part {SUBDOMAIN_MESSAGE}")
    else:
        raise SpecError(at, f"Invalid value: {_quoted(key)}: a qualified name {_QUALIFIED_EXAMPLES}"
                            " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')")
    if not name:
        raise SpecError(at, f"Invalid value: {_quoted(key)}: name part must be non-empty")
    if len(name) > QUALIFIED_NAME_MAX:
        raise SpecError(at, f"Invalid value: {_quoted(key)}: name part must be no more than 63 characters")
    if not _QUALIFIED.fullmatch(name):
        raise SpecError(at, f"Invalid value: {_quoted(key)}: name part {_QUALIFIED_EXAMPLES}")


def _string_map(value: Any, at: str) -> dict[str, str]:
    # ObjectMeta's labels and annotations are map[string]string: anything else fails to decode.
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(at, "must be a mapping of strings to strings")
    for key, item in value.items():
        if not isinstance(key, str):
            raise SpecError(at, f"key {_quoted(str(key))} must be a string")
        if not isinstance(item, str):
            raise SpecError(f"{at}.{key}", "must be a string")
    return dict(value)


def check_labels(value: Any, at: str) -> dict[str, str]:
    """ValidateLabels: keys qualified names, values valid label values."""
    labels = _string_map(value, at)
    for key, item in labels.items():
        _qualified_name(key, at)
        if len(item) > LABEL_VALUE_MAX:
            raise SpecError(at, f"Invalid value: {_quoted(item[:LABEL_VALUE_MAX + 1])}...: must be no more than 63 characters")
        if not _LABEL_VALUE.fullmatch(item):
            raise SpecError(at, f"Invalid value: {_quoted(item)}: {LABEL_VALUE_MESSAGE}")
    return labels


def check_annotations(value: Any, at: str) -> dict[str, str]:
    """ValidateAnnotations: keys qualified names (lower-cased first), keys and values together at
    most 256 KiB."""
    annotations = _string_map(value, at)
    total = 0
    for key, item in annotations.items():
        _qualified_name(key.lower(), at)
        total += len(key.encode(errors="surrogatepass")) + len(item.encode(errors="surrogatepass"))
        if total > TOTAL_ANNOTATION_SIZE:
            raise SpecError(at, f"Too long: must have at most {TOTAL_ANNOTATION_SIZE} bytes")
    return annotations
