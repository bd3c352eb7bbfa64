"""/metrics: the gateway's own counters, then every scheduler's published exposition.

Schedulers SET their Prometheus text into `{prefix}:metrics:{name}`. Several schedulers
expose the same families, and a scrape with a family declared twice is rejected, so the
texts are merged family by family and each sample gets a `scheduler="<name>"` label.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

# Fixed route names only: a fuzzer's random paths must not create new label values.
ENDPOINTS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
    "/v1/streams/{request_id}", "/tokenize", "/detokenize", "/health", "/ping", "/metrics",
    "/openapi.json", "/version"})


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pagedserve:gateway_requests", "HTTP requests answered.",
                                ["endpoint", "status"], registry=self.registry)
        self.streams = Gauge("pagedserve:gateway_requests_in_flight",
                             "Generation requests waiting on their output stream.",
                             registry=self.registry)
        self.aborts = Counter("pagedserve:gateway_aborts", "Aborts sent to the schedulers.",
                              ["reason"], registry=self.registry)
        self.tokens = Counter("pagedserve:gateway_generation_tokens",
                              "Completion tokens returned to clients (usage).",
                              registry=self.registry)
        self.rejected = Counter("pagedserve:gateway_rejected", "Requests refused before "
                                "enqueueing (429 queue full, 503 Redis down).", ["status"],
                                registry=self.registry)

    def observe(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


def merge_expositions(texts: list[tuple[str, str]]) -> str:
    """One valid exposition from several schedulers' texts: families once, samples labelled."""
    families: dict[str, list[str]] = {}     # family -> HELP/TYPE lines, then samples
    headers: dict[str, list[str]] = {}
    for scheduler, body in texts:
        label = 'scheduler="' + scheduler.replace("\\", "\\\\").replace('"', '\\"') + '"'
        family = None
        for line in body.splitlines():
            if not line.strip() or line.startswith("# EOF"):
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                headers.setdefault(family, [])
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
                families.setdefault(family, [])
                continue
            if line.startswith("#"):
                continue
            name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0),
                           default=len(line))
            name = line[:name_end]
            owner = family if family and name.startswith(family) else name
            if line[name_end:name_end + 1] == "{":
                close = line[name_end + 1:].lstrip()
                sep = "" if close.startswith("}") else ","
                line = f"{name}{{{label}{sep}{line[name_end + 1:]}"
            else:
                line = f"{name}{{{label}}}{line[name_end:]}"
            families.setdefault(owner, []).append(line)
    out = []
    for family, samples in families.items():
        out += headers.get(family, [])
        out += samples
    return "\n".join(out) + ("\n" if out else "")
