"""A stand-in web for the research agent: a search engine and pages, generated from the URL,
so the same query always finds the same pages (the outside world of the demo)."""

import hashlib
import time

TOPICS = ["history", "economics", "engineering", "policy", "open questions", "case studies"]


def search(query: str, limit: int = 12, delay: float = 0.0) -> list[dict]:
    time.sleep(delay)
    slug = "-".join(query.lower().split())[:40]
    return [
        {
            "url": f"https://example.org/{slug}/{i}",
            "title": f"{query}: {TOPICS[i % len(TOPICS)]} ({i})",
        }
        for i in range(limit)
    ]


def open_page(url: str, delay: float = 0.0) -> dict:
    time.sleep(delay)
    seed = hashlib.sha256(url.encode()).hexdigest()
    facts = [
        f"finding {seed[i : i + 4]} holds in {int(seed[i + 4 : i + 6], 16) % 90 + 10}% of cases"
        for i in range(0, 30, 6)
    ]
    return {"url": url, "text": f"Page {url}. " + ". ".join(facts) + "."}
