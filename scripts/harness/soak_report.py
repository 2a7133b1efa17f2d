"""The soak's figures and checks from what its run collected, and the table it prints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from scripts.harness.soak_checks import Check, flat_check, kv_check, registrations_check, tally
from scripts.harness.soak_churn import Churn
from scripts.harness.soak_client import Answer, Malformed, percentile_ms
from scripts.harness.soak_registrations import Registrations

_MIB = 1 << 20


def soak_summary(
    answers: Sequence[Answer],
    churn: Churn,
    malformed: Malformed,
    series: list[tuple[float, int, int, float]],
    span: float,
    kv: dict,
    listing: dict,
    model: Registrations,
    base: str,
    warm_s: float,
) -> tuple[dict, list[Check]]:
    """The soak's figures and its checks but the replay's (see ``soak_checks.replay_checks``)."""
    counts, checks = tally([*answers, *churn.probes], model, base)
    checks += [kv_check(kv), registrations_check(listing, model)]
    typed = sum(t for _, _, t in malformed.results)
    busy = sum(s == 503 for _, s, _ in malformed.results)
    kinds = dict(sorted(Counter(f"{k} {s}" for k, s, _ in malformed.results).items()))
    detail = f"{typed}/{len(malformed.results)} their own 4xx, {busy} a typed 503 (at --max-pending) {kinds}"
    checks.append(
        Check("malformed requests get their typed 4xx (or 503)", typed + busy == len(malformed.results), detail)
    )
    ops: dict[str, list[int]] = {}
    for r in churn.results:
        ops.setdefault(r.op, [0, 0])[0 if r.ok else 1] += 1
    bad = [r for r in churn.results if not r.ok]
    detail = ", ".join(f"{op} {good}/{good + wrong}" for op, (good, wrong) in sorted(ops.items()))
    detail += "".join(f"; {r.op} {r.adapter} -> {r.status} {r.note}" for r in bad[:3])
    checks.append(
        Check("admin churn answered as expected (broken adapters: typed 4xx, nothing changed)", not bad, detail)
    )
    rss = flat_check("RSS MiB", series, warm_s, 1, _MIB)
    threads = flat_check("threads", series, warm_s, 2, 1)
    host = flat_check("host tier MiB", series, warm_s, 3, _MIB)
    for row in (rss, threads):
        detail = (
            f"first {row['first']:.0f}, after warm-up {row['after_warm_up']:.0f}, last {row['last']:.0f}, "
            f"max {row['max']:.0f} ({100 * row['growth']:+.1f} %)"
        )
        if row is rss:
            detail += f"; host tier meanwhile {host['after_warm_up']:.0f} -> {host['last']:.0f} MiB"
        checks.append(Check(f"{row['name']} flat within 5 % after warm-up ({warm_s:.0f} s)", row["passed"], detail))
    admitted = [a for a in answers if a.streamed and a.outcome in ("ok", "cancelled")]
    whole = [a for a in answers if a.outcome == "ok"]
    figures = {
        "requests": len(answers),
        "span_s": span,
        "ok_req_s": len(whole) / span,
        "ttft_p50_ms": percentile_ms([a.ttft for a in admitted], 50),
        "ttft_p99_ms": percentile_ms([a.ttft for a in admitted], 99),
        "e2e_p50_ms": percentile_ms([a.done - a.sent for a in whole], 50),
        "e2e_p99_ms": percentile_ms([a.done - a.sent for a in whole], 99),
        "answers": counts,
        "churn_ops": ops,
        "churn_failures": [vars(r) for r in bad],
        "probes": len(churn.probes),
        "probe_retries_after_503": churn.probe_retries,
        "malformed": len(malformed.results),
        "kv": kv,
        "rss": rss,
        "threads": threads,
        "host_tier": host,
        "series": series,
    }
    return figures, checks


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(r: dict, checks: Sequence[Check]) -> None:
    s, rss, n = r["soak"], r["rss"], r["adapters"]
    sat, res = r["saturated"], r["resident"]
    rounds = r["saturation_rounds"]
    rounds_text = ", ".join(f"{100 * x['ratio']:.1f}" for x in rounds)
    per = r["rss_per_adapter"] / 1024
    less = r["rss_per_adapter_less_host_tier"] / 1024
    restored = r["rss_per_adapter_restored"] / 1024
    rows = [
        (
            "population",
            f"{n} adapters, {r['population_bytes'] / 2**30:.2f} GiB; disk bound {r['disk_bound_bytes'] / 2**30:.2f} "
            f"GiB; written in {r['population_write_s']:.1f} s (what was missing)",
        ),
        (
            "register",
            f"{r['register_s']:.1f} s for {n} ({1000 * r['register_s'] / n:.1f} ms each, {r['args']['in_flight']} in "
            f"flight); {len(r['register_failed'])} refused",
        ),
        (
            "restart",
            f"{r['restart_s']:.1f} s to serve, {r['restored']} restored (empty state: {r['start_empty_s']:.1f} s)",
        ),
        ("/v1/models", f"{r['models_ms']:.1f} ms, median of 10 ({r['models_entries']} entries)"),
        ("/v1/adapters", f"{r['adapters_ms']:.1f} ms, median of 10 ({r['adapters_entries']} entries)"),
        (
            "RSS / adapter",
            f"{per:.1f} KiB registered ({less:.1f} KiB less the host tier's {rss['host_tier_used'] / 2**20:.0f} MiB); "
            f"{restored:.1f} KiB restored (nothing prepared)",
        ),
        (
            "saturated",
            f"population {sat['req_per_s']:.2f} req/s, all-resident {res['req_per_s']:.2f} req/s ({res['pinned']} of "
            f"{res['used']} used adapters pinned): {100 * r['saturated_ratio']:.1f} %, the median of "
            f"{len(rounds)} rounds ({rounds_text} %; target >= 95 %)",
        ),
        (
            "soak",
            f"{s['requests']} requests offered at {s['offered_req_s']:.2f} req/s ({r['args']['load']}x the "
            f"population's burst), answered whole {s['ok_req_s']:.2f} req/s over {s['span_s']:.0f} s; "
            f"{s['probes']} churn probes, {s['malformed']} malformed",
        ),
        (
            "TTFT admitted",
            f"p50 {_ms(s['ttft_p50_ms'])} ms, p99 {_ms(s['ttft_p99_ms'])} ms (streams, from arrival); e2e p50/p99 "
            f"{_ms(s['e2e_p50_ms'])}/{_ms(s['e2e_p99_ms'])} ms",
        ),
    ]
    print(f"\nsoak on {r['cpu']}: {r['command']}")
    for name, text in rows:
        print(f"  {name:14s} {text}")
    print("checks:")
    for check in checks:
        print(check.line())
    failed = sum(not c.passed for c in checks)
    print(f"{len(checks) - failed}/{len(checks)} checks passed")
