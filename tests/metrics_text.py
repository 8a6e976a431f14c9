"""A /metrics exposition read with prometheus_client's own parser, as a scraper reads it."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, model_name: str = "tiny") -> dict[str, float]:
    """Each sample's value by its name and labels, written name{label="value",...} with
    the labels sorted and model_name left out (asserted on every sarathi_rt: sample);
    also "<type> <family name>" (e.g. "histogram sarathi_rt:inter_token_latency_seconds")
    -> 1.0 for each sarathi_rt: family, to assert its type."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("sarathi_rt:"):
            out[f"{family.type} {family.name}"] = 1.0
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("sarathi_rt:"):
                assert labels.pop("model_name") == model_name, s
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[s.name + (f"{{{inner}}}" if inner else "")] = s.value
    return out


def scrape(base: str) -> dict[str, float]:
    """`samples` of the server at `base` (its URL, with or without the trailing /v1)."""
    import httpx

    response = httpx.get(base.removesuffix("/v1") + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text)
