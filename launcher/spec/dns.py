"""The pod DNS fields of a VMI (spec.dnsPolicy, spec.dnsConfig), checked as KubeVirt's VMI admitter checks them
(pure). The launcher attaches no network, so they change nothing it runs; KubeVirt refuses bad ones all the same.

Rules and words: pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go validateDNSPolicy and
validatePodDNSConfig (themselves Kubernetes' pod validation)."""

from __future__ import annotations

import ipaddress

from launcher.spec.fields import SpecError, as_list, as_map, dns_subdomain_problems, get_str

POLICIES = ("ClusterFirstWithHostNet", "ClusterFirst", "Default", "None", "")
MAX_NAMESERVERS = 3
MAX_SEARCHES = 6
MAX_SEARCH_CHARS = 256


def check_dns(spec: dict, root: str) -> None:
    policy = spec.get("dnsPolicy")
    if policy is not None:
        policy = get_str(spec, "dnsPolicy", root) or ""
        if policy not in POLICIES:
            raise SpecError(f"{root}.dnsPolicy", f"DNSPolicy: {policy} is not supported, valid values: [{' '.join(POLICIES)}]")
    at = f"{root}.dnsConfig"
    config = spec.get("dnsConfig")
    if policy == "None" and config is None:
        raise SpecError(at, "must provide `dnsConfig` when `dnsPolicy` is None")
    config = as_map(config, at)
    servers = [str(s) for s in as_list(config.get("nameservers"), f"{at}.nameservers")]
    if policy == "None" and not servers:
        raise SpecError(f"{at}.nameservers", "must provide at least one DNS nameserver when `dnsPolicy` is None")
    if len(servers) > MAX_NAMESERVERS:
        raise SpecError(f"{at}.nameservers", f"must not have more than {MAX_NAMESERVERS} nameservers: [{' '.join(servers)}]")
    for server in servers:
        try:
            ipaddress.ip_address(server)
        except ValueError:
            raise SpecError(f"{at}.nameservers", f"must be valid IP address: {server}") from None
    searches = [str(s) for s in as_list(config.get("searches"), f"{at}.searches")]
    if len(searches) > MAX_SEARCHES:
        raise SpecError(f"{at}.searches", f"must not have more than {MAX_SEARCHES} search paths")
    if len(" ".join(searches)) > MAX_SEARCH_CHARS:
        raise SpecError(f"{at}.searches", f"must not have more than {MAX_SEARCH_CHARS} characters (including spaces) in the search list")
    for search in searches:
        problems = dns_subdomain_problems(search)
        if problems:
            raise SpecError(f"{at}.searches", problems[0])
    for i, option in enumerate(as_list(config.get("options"), f"{at}.options")):
        if not as_map(option, f"{at}.options[{i}]").get("name"):
            raise SpecError(f"{at}.options[{i}].name", "Option.Name must not be empty")
