"""spec.domain.clock (pure): the guest clock's offset and its timers, as KubeVirt reads them.

staging/src/kubevirt.io/api/core/v1/schema.go (Clock, ClockOffset, Timer) with the API's defaults
(defaults.go: every timer given is present unless it says `present: false`). KubeVirt's webhooks check
nothing here and pass the tick policies on; libvirt refuses the ones a timer cannot have, so those are
refused here in libvirt's words (src/conf/domain_conf.c, src/qemu/qemu_validate.c).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.spec.fields import SpecError, as_map, get_bool, get_str

# KubeVirt's timers, in the order its converter appends them (compute/clock.go)
TIMERS = ("rtc", "pit", "kvm", "hpet", "hyperv")
# the tick policies each timer takes (the schema's lists; libvirt refuses the others)
TICK_POLICIES = {"hpet": ("delay", "catchup", "merge", "discard"), "pit": ("delay", "catchup", "discard"),
                 "rtc": ("delay", "catchup")}
LIBVIRT_POLICIES = ("delay", "catchup", "merge", "discard")
TRACKS = ("guest", "wall")
INT64 = 2**63


@dataclass(frozen=True)
class Timer:
    name: str  # KubeVirt's, one of TIMERS
    present: bool = True
    tick_policy: str | None = None
    track: str | None = None  # rtc only


@dataclass(frozen=True)
class Clock:
    offset: str | None = None  # "utc" | "timezone" | None (neither given)
    offset_seconds: int | None = None  # utc.offsetSeconds
    timezone: str | None = None
    timers: tuple[Timer, ...] = ()  # in TIMERS' order


def _tick_policy(name: str, doc: dict, at: str) -> str | None:
    policy = get_str(doc, "tickPolicy", at)
    if policy is None:
        return None
    if policy not in LIBVIRT_POLICIES:
        raise SpecError(f"{at}.tickPolicy", f"unknown timer tickpolicy '{policy}'")
    if policy not in TICK_POLICIES[name]:
        what = "rtc timer" if name == "rtc" else name
        raise SpecError(f"{at}.tickPolicy", f"unsupported {what} tickpolicy '{policy}'")
    return policy


def _timer(name: str, doc: dict, at: str) -> Timer:
    present = get_bool(doc, "present", at, default=True)
    policy = _tick_policy(name, doc, at) if name in TICK_POLICIES else None
    track = None
    if name == "rtc":
        track = get_str(doc, "track", at)
        if track is not None and track not in TRACKS:
            raise SpecError(f"{at}.track", f"unknown timer track '{track}'")
    return Timer(name, present, policy, track)


def _offset_seconds(doc: dict, at: str) -> int | None:
    value = doc.get("offsetSeconds")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{at}.offsetSeconds", "must be an integer")
    if not -INT64 <= value < INT64:
        raise SpecError(f"{at}.offsetSeconds", "must fit in 64 bits")
    return value


def parse_clock(doc: dict, at: str) -> Clock:
    """spec.domain.clock at `at`. With both utc and timezone (the schema says exactly one), utc wins, as in
    KubeVirt's converter."""
    offset = seconds = timezone = None
    if doc.get("utc") is not None:
        offset, seconds = "utc", _offset_seconds(as_map(doc["utc"], f"{at}.utc"), f"{at}.utc")
    elif doc.get("timezone") is not None:
        timezone = doc["timezone"]
        if not isinstance(timezone, str):
            raise SpecError(f"{at}.timezone", "must be a string")
        if not timezone:
            raise SpecError(f"{at}.timezone", "missing 'timezone' attribute for clock with offset='timezone'")  # libvirt's words
        offset = "timezone"
    timer_doc = as_map(doc.get("timer"), f"{at}.timer")
    timers = tuple(_timer(name, as_map(timer_doc[name], f"{at}.timer.{name}"), f"{at}.timer.{name}")
                   for name in TIMERS if timer_doc.get(name) is not None)
    return Clock(offset, seconds, timezone, timers)
