"""Adapters: agents written for another framework get a checkpointed Stepguard step per model
call and per tool call, with budgets, approvals and halts, without a rewrite. Each needs its
framework, installed as an extra: `stepguard[openai-agents]`, `stepguard[pydantic-ai]`,
`stepguard[langgraph]`; MCP servers' tools (runs.adapters.mcp) need `stepguard[mcp]`."""
