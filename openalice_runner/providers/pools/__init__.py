"""Self-hosted engine pools (`type: sglang`, `type: vllm`): one pool model shared by the two dialects,
their launch settings and the checks across the routing and policy files."""
