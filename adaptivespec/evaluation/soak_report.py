"""What a served soak found (:class:`SoakReport`, written as ``soak.json``), the targets it checks and
its memory plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from adaptivespec.evaluation.soak import RSS_GROWTH_LIMIT, Outcome, rss_growth


@attrs.frozen(kw_only=True)
class SoakReport:
    """What a soak found; :meth:`to_json` is the file ``soak.json``."""

    config: str
    requests: int
    concurrency: int
    seconds: float
    outcomes: tuple[Outcome, ...]
    rss_series: tuple[tuple[float, int, float], ...]
    metrics: dict[str, float]
    answered_after: bool
    not_run: int = 0
    rss_limit: float = RSS_GROWTH_LIMIT
    """The largest resident-memory growth that passes (``soak --max-rss-growth``), a fraction."""

    @property
    def counts(self) -> dict[str, int]:
        valid = [o for o in self.outcomes if not o.kind.startswith("bad_")]
        bad = [o for o in self.outcomes if o.kind.startswith("bad_")]
        return {
            "valid": len(valid), "valid_completed": sum(o.ok for o in valid),
            "bad": len(bad), "bad_4xx_naming_field": sum(o.ok for o in bad),
            "bad_4xx": sum(o.status is not None and 400 <= o.status < 500 for o in bad),
            "http_5xx": sum(o.status is not None and o.status >= 500 for o in self.outcomes),
            "http_503": sum(o.status == 503 for o in self.outcomes),
            "hangs": sum(o.status is None and o.detail.startswith("hang") for o in self.outcomes),
            "no_answer": sum(o.status is None for o in self.outcomes),
            "schema_invalid": sum(o.schema_valid is False for o in self.outcomes),
            "not_run": self.not_run,
        }

    @property
    def rss_growth(self) -> float | None:
        return rss_growth(list(self.rss_series), self.requests)

    def state_bounded(self) -> bool | None:
        """The controller's per-request state after the traffic is within the batch (None: the
        server exports no controller series, e.g. metrics off or plain decoding)."""
        pending = self.metrics.get("adaptivespec_controller_pending_steps")
        tracked = self.metrics.get("adaptivespec_controller_tracked_requests")
        if pending is None or tracked is None:
            return None
        return pending <= self.concurrency and tracked <= self.concurrency

    def failures(self) -> list[str]:
        """The targets that do not hold, one line each (empty: all hold)."""
        c, out = self.counts, []
        if c["valid_completed"] < c["valid"]:
            out.append(f"{c['valid'] - c['valid_completed']} of {c['valid']} valid requests did not complete")
        if c["bad_4xx_naming_field"] < c["bad"]:
            out.append(f"{c['bad'] - c['bad_4xx_naming_field']} of {c['bad']} bad requests got no 4xx naming the field")
        for key in ("http_5xx", "hangs", "no_answer", "not_run"):
            if c[key]:
                out.append(f"{key}: {c[key]}")
        growth = self.rss_growth
        if growth is not None and growth >= self.rss_limit:
            out.append(f"resident memory grew {growth:.1%} (limit {self.rss_limit:.0%})")
        if self.state_bounded() is False:
            out.append("the controller's per-request state exceeds the batch after the traffic")
        if not self.answered_after:
            out.append("the server did not answer after the soak")
        return out

    def to_json(self) -> dict[str, Any]:
        by_kind = {k: {"sent": n, "ok": sum(o.ok for o in self.outcomes if o.kind == k)}
                   for k, n in sorted(Counter(o.kind for o in self.outcomes).items())}
        growth = self.rss_growth
        return {"config": self.config, "requests": self.requests, "concurrency": self.concurrency,
                "seconds": round(self.seconds, 1), **self.counts, "by_kind": by_kind,
                "rss_growth": None if growth is None else round(growth, 4), "rss_limit": self.rss_limit,
                "rss_series": [list(s) for s in self.rss_series], "state_bounded": self.state_bounded(),
                "answered_after": self.answered_after, "metrics": self.metrics, "failures": self.failures(),
                "examples": [attrs.asdict(o) for o in self.outcomes if not o.ok][:20]}


def figure(report: SoakReport):
    """Resident memory of the server over the soak, against requests finished (a matplotlib Figure)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    xs = [n for _, n, _ in report.rss_series]
    ys = [mib for _, _, mib in report.rss_series]
    ax.plot(xs, ys, marker=".", label="server RSS (all its processes)")
    growth = report.rss_growth
    ax.set_xlabel("requests finished")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(f"{Path(report.config).stem}: {report.requests} requests, {report.concurrency} at a time"
                 + ("" if growth is None else f", growth {growth:+.1%}"))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def metrics_figure(metrics: dict[str, float], title: str = ""):
    """What ``/metrics`` said after a soak: decode steps per tree shape, and the distribution of
    accepted drafted tokens per request and step (from the ``adaptivespec_*`` series; a matplotlib Figure)."""
    import re

    from matplotlib.figure import Figure

    shapes = {m.group(1): v for k, v in metrics.items() if (m := re.fullmatch(r'adaptivespec_steps_total\{shape="([^"]+)"\}', k))}
    cum = sorted((float(m.group(1)), v) for k, v in metrics.items()
                 if (m := re.fullmatch(r'adaptivespec_accepted_tokens_per_step_bucket\{le="([0-9.]+)"\}', k)))
    fig = Figure(figsize=(10, 3.4))
    left, right = fig.subplots(1, 2)
    order = sorted(shapes, key=lambda s: tuple(int(x) for x in s.split(",")))
    left.bar(order, [shapes[s] for s in order], color="#4a6fa5")
    left.set_xlabel("tree shape (nsteps,topk,ndt)")
    left.set_ylabel("decode steps")
    left.set_title("adaptivespec_steps_total by shape", fontsize=9)
    counts = [n - (cum[i - 1][1] if i else 0.0) for i, (_, n) in enumerate(cum)]
    right.bar([int(le) for le, _ in cum], counts, color="#a5704a")
    right.set_xlabel("drafted tokens accepted (one request, one step)")
    right.set_ylabel("observations")
    total, total_sum = metrics.get("adaptivespec_accepted_tokens_per_step_count", 0.0), metrics.get("adaptivespec_accepted_tokens_per_step_sum", 0.0)
    mean = f", mean {total_sum / total:.2f}" if total else ""
    right.set_title(f"adaptivespec_accepted_tokens_per_step{mean}", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
