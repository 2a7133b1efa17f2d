"""The commands on a running server: `register`, `list`, `unregister` (its adapter admin API) and `metrics`."""

from __future__ import annotations

import argparse
import json

from .cli_exit import OK, SERVER_ERROR, USAGE_ERROR, fail
from .client import DEFAULT_URL, TOKEN_ENV, URL_ENV, ServerClient, ServerError


def add_parsers(commands: argparse._SubParsersAction) -> None:
    register = _add_client_command(commands, "register", "register an adapter on a running server")
    register.add_argument("ref", help="hub id org/name[@revision], or a local directory (starts with / or ./)")
    register.add_argument("--id", default=None, help="adapter id to serve it under (default: the repo id or dir name)")
    register.add_argument("--revision", default=None, help="hub branch, tag or commit sha")
    register.add_argument("--pin", action="store_true", help="keep it resident in a device slot")
    _add_client_command(commands, "list", "list a running server's adapters")
    unregister = _add_client_command(commands, "unregister", "unregister an adapter from a running server")
    unregister.add_argument("adapter_id")
    metrics = _add_client_command(commands, "metrics", "swap latency per tier, hit rates, evictions and stall")
    metrics.add_argument("--prometheus", action="store_true", help="print the Prometheus text of /metrics")


def _add_client_command(commands: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.add_argument("--url", default=None, help=f"server URL (default ${URL_ENV} or {DEFAULT_URL})")
    sub.add_argument("--admin-token", default=None, help=f"bearer token for admin routes (default ${TOKEN_ENV})")
    sub.add_argument("--json", action="store_true", help="print the server's JSON answer")
    sub.set_defaults(run=run)
    return sub


def run(args: argparse.Namespace) -> int:
    try:
        with ServerClient(args.url, args.admin_token) as client:
            if args.command == "register":
                answer = client.register(args.ref, args.id, args.revision, args.pin)
                text = f"{answer['action']} {answer['id']} sha {answer['sha']} rank {answer['rank']} ({answer['tier']})"
            elif args.command == "unregister":
                answer = client.unregister(args.adapter_id)
                text = f"unregistered {answer['id']}"
            elif args.command == "list":
                answer = client.adapters()
                text = _adapter_table(answer)
            elif args.prometheus:
                print(client.prometheus(), end="")
                return OK
            else:
                answer = client.swaps()
                text = _metrics_table(answer)
    except ServerError as err:
        return fail(SERVER_ERROR if err.status == 0 or err.status >= 500 else USAGE_ERROR, err)
    print(json.dumps(answer, indent=2) if args.json else text)
    return OK


def _adapter_table(adapters: list[dict]) -> str:
    lines = [f"{'id':40} {'rank':>4} {'MB':>7} {'tier':5} {'slot':>4} {'pinned':6} sha"]
    for a in adapters:
        slot = "" if a["slot"] is None else str(a["slot"])
        tier = a["tier"] or a["status"]
        lines.append(
            f"{a['id']:40} {a['rank'] or 0:4d} {a['bytes'] / 1e6:7.2f} {tier:5} {slot:>4} "
            f"{'yes' if a['pinned'] else '':6} {a['sha'][:12]}"
        )
    return "\n".join(lines)


def _metrics_table(snapshot: dict) -> str:
    lines = [f"{'move':14} {'count':>6} {'MB':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    for move, s in sorted(snapshot["moves"].items()):
        ms = " ".join(f"{s[k] * 1e3:8.2f}" for k in ("p50_s", "p95_s", "p99_s", "max_s"))
        lines.append(f"{move:14} {s['count']:6d} {s['total_bytes'] / 1e6:9.2f} {ms}")
    for tier in sorted(set(snapshot["hits"]) | set(snapshot["misses"])):
        hits = snapshot["hits"].get(tier, 0)
        misses = snapshot["misses"].get(tier, 0)
        rate = snapshot["hit_rates"].get(tier, 0.0)
        evictions = snapshot["evictions"].get(tier, 0)
        lines.append(f"{tier} tier: hit rate {rate:.1%} ({hits} hits, {misses} misses), {evictions} evictions")
    for name, what in (("stall", "steps blocked on moves"), ("adapter_wait", "requests waiting for their adapter")):
        wait = snapshot.get(name)
        if wait:
            lines.append(
                f"{name.replace('_', ' ')}: {wait['count']} {what}, total {wait['total_seconds']:.3f}s, "
                f"p50 {wait['p50_s'] * 1e3:.2f} ms, p99 {wait['p99_s'] * 1e3:.2f} ms, max {wait['max_s'] * 1e3:.2f} ms"
            )
    kv = snapshot.get("kv")
    if kv:
        lines.append(
            f"kv cache: {kv['blocks_used']} / {kv['blocks_total']} blocks used, {kv['blocks_cached']} cached, "
            f"{kv['block_size']} tokens each; prefix hit rate {kv['prefix_hit_rate']:.1%} "
            f"({kv['prefix_hit_tokens']} of {kv['prefix_queried_tokens']} tokens, {kv['prefix_hit_requests']} of "
            f"{kv['prefix_queried_requests']} requests), {kv['preemptions']} preemptions"
        )
    return "\n".join(lines)
