"""Issue 46, finding 9: no schema takes the server down. The probe's two requests (a chain of 1,000
`$defs`, a chain of 5,000 bare `$ref` aliases: each crashed llguidance with SIGSEGV) sent to a real
`serve` process are a 400 naming the field, and it serves the next request; and a schema past what
llguidance can compile that the request checks do not catch crashes only the grammar checker's child
(grammar_check.py), not the process that compiles it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from locations import REPO, TESTS
from stand_ins.processes import free_port, wait_http

from engine.grammar.test_refs import alias_chain, def_chain

KEY = "isolation-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    providers = tmp / "providers.yaml"
    providers.write_text(
        "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 8}\n"
        "routes:\n  - {name: default, chain: [local]}\n"
    )
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENALICE_API_KEY": KEY, "PYTHONPATH": str(REPO)}
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "openalice_runner", "serve", "--port", str(port), "--providers", str(providers)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny-random", "messages": HI, "max_tokens": 16,
                                                          **body}, headers=AUTH, timeout=120)  # fmt: skip


def fmt(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def tool(schema: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", **schema}}}],
            "tool_choice": "required"}  # fmt: skip


@pytest.mark.parametrize(("body", "param"), [
    (fmt(def_chain(1_000)), "response_format.json_schema.schema"),
    (tool(def_chain(1_000)), "tools[0].function.parameters"),
    (fmt(alias_chain(5_000)), "response_format.json_schema.schema"),
    (tool(alias_chain(5_000)), "tools[0].function.parameters"),
])  # fmt: skip
def test_the_probes_ref_chains_are_a_400_and_the_server_serves_on(serve, body, param):
    url, proc = serve
    try:
        r = post(url, body)
    except httpx.HTTPError as exc:  # the connection dropped: the process died
        pytest.fail(f"no answer ({exc!r}); serve's exit status: {proc.poll()}")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "$refs" in error["message"], error
    assert proc.poll() is None
    after = post(url, fmt({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert after.status_code == 200, after.text


# A schema past llguidance's stack, straight to the compiler (the request checks would refuse it).
CRASHER = textwrap.dedent("""
    import sys
    from transformers import AutoTokenizer
    from openalice_runner.engine.grammar import GrammarCompiler, GrammarError, json_grammar
    from openalice_runner.engine.model_loading import converted_folder, resolve_model_source
    from engine.grammar.test_refs import def_chain

    tokenizer = AutoTokenizer.from_pretrained(converted_folder(resolve_model_source(None)))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    for _ in range(2):  # the second is answered from the failures remembered
        try:
            compiler.compile(json_grammar(def_chain(1_000)))
            print("compiled")
        except GrammarError as exc:
            print("refused:", exc.code, exc)
    compiler.compile(json_grammar({"type": "integer"}))
    print("alive")
""")


def test_a_schema_that_crashes_the_grammar_compiler_crashes_only_its_checker():
    # The child imports the chain builder from the tests' own tree (tests/ is not a package).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", CRASHER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "alive", lines
    refusals = [line for line in lines if line.startswith("refused:")]
    assert len(refusals) == 2 and all("crashed" in line and "SIGSEGV" in line for line in refusals), lines
    assert all(" invalid_value " in line for line in refusals)
