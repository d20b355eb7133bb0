"""Reading fields of Kubernetes objects (pure): typed getters, quantities and names, each failure a
`SpecError` naming the field path, in Kubernetes' and KubeVirt's wording."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from diskkit.errors import DiskkitError


class SpecError(DiskkitError):
    """A field KubeVirt, CDI (or this launcher) cannot accept; subject is the field path."""


DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SUBDOMAIN_MESSAGE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must"
                     " start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is"
                     " '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")


# ---------------------------------------------------------------- quantities

_QUANTITY = re.compile(r"([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
QUANTITY_FORMAT = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"


def parse_quantity(value: Any, at: str) -> Fraction:
    """A Kubernetes resource.Quantity (`1Gi`, `512M`, `500m`, `1e9`, a bare number), exactly."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SpecError(at, QUANTITY_FORMAT)
    text = str(value).strip()
    match = _QUANTITY.fullmatch(text)
    if not match or match.group(1) in (".", "+.", "-."):
        raise SpecError(at, QUANTITY_FORMAT)
    number, suffix = match.groups()
    try:
        amount = Fraction(number)
    except ValueError:
        raise SpecError(at, QUANTITY_FORMAT) from None
    if suffix in _BINARY:
        amount *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        amount *= _DECIMAL[suffix]
    elif re.fullmatch(r"[eE][-+]?[0-9]+", suffix):
        amount *= Fraction(10) ** int(suffix[1:])
    else:
        raise SpecError(at, QUANTITY_FORMAT)
    if amount < 0:
        raise SpecError(at, f"'{text}': must be greater than or equal to 0.")
    return amount


def to_bytes(amount: Fraction) -> int:
    # pkg/.../vcpu QuantityToByte: a fractional byte count ends up rounded down.
    return math.floor(amount)


def to_millis(amount: Fraction) -> int:
    # resource.Quantity.MilliValue rounds up.
    return math.ceil(amount * 1000)


# ---------------------------------------------------------------- reading helpers

def field_error(at: str, message: str) -> SpecError:
    if message.startswith(at + " "):
        return SpecError(at, message[len(at) + 1:])
    return SpecError(at, message)


def as_map(value: Any, at: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(at, "must be a mapping")
    return value


def as_list(value: Any, at: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(at, "must be a list")
    return value


def get_str(doc: dict, key: str, at: str, required: bool = False) -> str | None:
    value = doc.get(key)
    if value is None or value == "":
        if required:
            raise SpecError(f"{at}.{key}", "required")
        return None
    if not isinstance(value, str):
        raise SpecError(f"{at}.{key}", "must be a string")
    return value


def get_bool(doc: dict, key: str, at: str, default: bool | None = False) -> bool | None:
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"{at}.{key}", "must be true or false")
    return value


def get_int(doc: dict, key: str, at: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{at}.{key}", "must be a non-negative integer")
    return value


def get_quantity(doc: dict, key: str, at: str) -> Fraction | None:
    value = doc.get(key)
    return None if value is None else parse_quantity(value, f"{at}.{key}")


def did_you_mean(value: object, choices) -> str:
    """"; did you mean "X"?" for the closest of `choices` to a typo'd `value` (case first), else ""."""
    if not isinstance(value, str):
        return ""
    choices = [c for c in choices if isinstance(c, str)]
    same_case = [c for c in choices if c.lower() == value.lower()]
    import difflib

    close = same_case or difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f'; did you mean "{close[0]}"?' if close else ""


def check_one_of(value: str | None, allowed: tuple[str, ...], at: str) -> None:
    if value is not None and value not in allowed:
        supported = ", ".join(f'"{a}"' for a in allowed)
        raise SpecError(at, f'Unsupported value: "{value}": supported values: {supported}{did_you_mean(value, allowed)}')


def dns_label_problems(name: str) -> list[str]:
    """k8s.io/apimachinery validation.IsDNS1123Label, its messages."""
    problems = []
    if len(name) > 63:
        problems.append("must be no more than 63 characters")
    if not DNS1123_LABEL.fullmatch(name):
        problems.append("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-',"
                        " and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc',"
                        " regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
    return problems


def dns_subdomain_problems(name: str) -> list[str]:
    """k8s.io/apimachinery validation.IsDNS1123Subdomain, its messages."""
    problems = []
    if len(name) > 253:
        problems.append("must be no more than 253 characters")
    if not DNS1123_SUBDOMAIN.fullmatch(name):
        problems.append(SUBDOMAIN_MESSAGE)
    return problems


def check_dns_label(name: str, at: str) -> None:
    # KubeVirt applies IsDNS1123Label to disk and volume names
    problems = dns_label_problems(name)
    if problems:
        raise SpecError(at, problems[0])


def dig(doc: Any, *keys: str) -> Any:
    """doc[k1][k2]..., None as soon as a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc
