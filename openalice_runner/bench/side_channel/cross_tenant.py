"""Whether one tenant's text drafts for another (issue 48, Build 4): one `serve` with a keys file and
suffix speculation (the drafter that reuses earlier replies), the default model, greedy.

For each prompt: tenant `a` writes a reply; tenant `b-K` then sends the same request (its reply is
`a`'s, token for token: the most a shared store could give it); a tenant that has sent nothing
(`fresh-K`, an empty store) sends it too; and `a` sends it again, the control within one tenant.
Then `a` and right after it `b-K` send the conversation's next call (`a`'s reply and a new user turn,
the same conversation id): only `a`'s may find its prefix cached. The report gives accepted drafts (from the
replies' speculation block) and cached prompt tokens (usage). Isolation holds where `b-K` accepts
what the fresh tenant accepts and has nothing cached, while `a` accepts more and has its prefix.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from typing import Any

from openalice_runner.server.tenants.keys_file import key_hash

PROMPTS = (
    "Write the launch checklist for the orbital relay station, step by step, with a number for each step.",
    "Draft a short incident report about the cafeteria's broken espresso machine on the third floor.",
    "Describe the rules of a made-up board game called Lantern Harbor in one paragraph.",
    "Write a product description for a waterproof notebook named the Tidewriter 9.",
)
ISOLATED_SHARE = 0.1  # b's gain over an empty store, as a share of the writer's own gain, isolation allows
POLICY = 'version: 1\nname: suffix\ndescription: cross-tenant bench\ndefault: {method: suffix, gamma: 4}\n'


def run(prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 96, providers: str | None = None,
        log=print) -> dict[str, Any]:
    import httpx

    from openalice_runner.bench.loop_targets import Servers, TargetSpec

    # per prompt a new `b` and a new fresh tenant: both start with empty stores and statistics, so
    # whatever b accepts beyond the fresh one came from a's
    names = ["a", *(f"{role}-{k}" for k in range(len(prompts)) for role in ("b", "fresh"))]
    keys = {name: secrets.token_urlsafe(24) for name in names}
    with tempfile.TemporaryDirectory(prefix="cross-tenant-") as tmp:
        keys_file, policy = Path(tmp) / "keys.yaml", Path(tmp) / "policy.yaml"
        keys_file.write_text("tenants:\n" + "".join(f"  - name: {n}\n    hash: {key_hash(k)}\n" for n, k in keys.items()))
        keys_file.chmod(0o600)
        policy.write_text(POLICY)
        with Servers(policy=str(policy), providers=providers, log=log) as servers, \
                httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            url = servers.start(TargetSpec("tenants", sidecar="policy", args=["--keys", str(keys_file)])).url

            def ask(tenant: str, messages: list[dict[str, str]], conversation: str) -> dict[str, Any]:
                body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
                # every tenant names the same conversation: the id is scoped by tenant, so only the
                # writer's repeat may find its prompt in the prefix cache
                headers = {"Authorization": f"Bearer {keys[tenant]}", "X-OpenAlice-Conversation-Id": conversation}
                response = client.post(f"{url}/chat/completions", json=body, headers=headers)
                if response.status_code != 200:
                    raise RuntimeError(f"{tenant}: HTTP {response.status_code}: {response.text[:300]}")
                reply = response.json()
                spec, usage = reply.get("speculation") or {}, reply["usage"]
                return {"tenant": tenant, "text": reply["choices"][0]["message"].get("content") or "",
                        "completion_tokens": usage["completion_tokens"], "accepted": spec.get("accepted"),
                        "proposed": spec.get("proposed"),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}

            rows = []
            for k, prompt in enumerate(prompts):
                conversation, opening = f"conversation-{k}", [{"role": "user", "content": prompt}]
                writer = ask("a", opening, conversation)
                other, fresh = ask(f"b-{k}", opening, conversation), ask(f"fresh-{k}", opening, conversation)
                again = ask("a", opening, conversation)
                # the conversation's next call, as a loop sends it: the writer's history is cached, and
                # only under the writer's tenant
                follow = [*opening, {"role": "assistant", "content": writer["text"]},
                          {"role": "user", "content": "Now shorter."}]
                # a's first, then b's at once: a's history then sits in the engine's free slot, where a
                # shared cache would serve b from it
                follow_same, follow_other = ask("a", follow, conversation), ask(f"b-{k}", follow, conversation)
                rows.append({"prompt": k, "writer": writer, "other_tenant": other, "fresh_tenant": fresh,
                             "same_tenant": again, "same_text": other["text"] == writer["text"] == fresh["text"],
                             "follow_up_cached": {"other_tenant": follow_other["cached_tokens"],
                                                  "same_tenant": follow_same["cached_tokens"]}})
                log(f"prompt {k}: accepted b {other['accepted']}, fresh {fresh['accepted']}, a again {again['accepted']}")
    return {"max_tokens": max_tokens, "rows": rows, "summary": summary(rows)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def total(role: str, field: str) -> int:
        return sum(r[role][field] or 0 for r in rows)

    cached = {role: sum(r["follow_up_cached"][role] or 0 for r in rows) for role in ("other_tenant", "same_tenant")}
    accepted = {role: total(role, "accepted") for role in ("other_tenant", "fresh_tenant", "same_tenant")}
    # what b gained over an empty store, as a share of what the writer's own store gave it: 0 isolated,
    # 1 shared. Not exactly 0 even so: draft lengths follow the measured pass costs (timing)
    gain = accepted["same_tenant"] - accepted["fresh_tenant"]
    leak = round((accepted["other_tenant"] - accepted["fresh_tenant"]) / gain, 3) if gain > 0 else None
    return {
        "accepted": accepted,
        "leaked_share": leak,
        "follow_up_cached_tokens": cached,
        "completion_tokens": total("writer", "completion_tokens"),
        "same_text": f"{sum(r['same_text'] for r in rows)}/{len(rows)}",
        "isolated": leak is not None and abs(leak) <= ISOLATED_SHARE and cached["other_tenant"] == 0,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = ["| prompt | reply tokens | b accepted | fresh accepted | a again accepted | "
             "next call cached: b | next call cached: a |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['prompt']} | {r['writer']['completion_tokens']} | {r['other_tenant']['accepted']} | "
                     f"{r['fresh_tenant']['accepted']} | {r['same_tenant']['accepted']} | "
                     f"{r['follow_up_cached']['other_tenant']} | {r['follow_up_cached']['same_tenant']} |")
    lines += ["", f"summary: {report['summary']}"]
    return "\n".join(lines)
