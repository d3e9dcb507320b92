"""A small MCP server for tests/test_adapter_mcp.py, written with the official SDK's MCPServer
(FastMCP in mcp 1.x): `python tests/mcp_server.py CALLS_FILE` on stdio, or
`python tests/mcp_server.py CALLS_FILE http PORT` over streamable HTTP on 127.0.0.1; with
`--extra` it has one tool more (a server whose list changed under a running workflow).

Every call of a tool with a side effect appends a line to CALLS_FILE (the tool, its arguments and
the idempotency key the client put in the request's `_meta`), so a test counts what the server
really did, whatever the workflow recorded.
"""

import json
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

IDEMPOTENCY_META_KEY = "stepguard.dev/idempotency-key"  # runs.adapters.mcp's

server = MCPServer("stepguard-test-tools")


def record(tool: str, args: dict, ctx: Context) -> None:
    meta = ctx.request_context.meta or {}
    line = {"tool": tool, "args": args, "key": meta.get(IDEMPOTENCY_META_KEY)}
    with open(sys.argv[1], "a") as calls:
        calls.write(json.dumps(line) + "\n")


@server.tool()
def send_note(to: str, text: str, ctx: Context) -> str:
    """Send a note to a colleague (a side effect: counted at the server)."""
    record("send_note", {"to": to, "text": text}, ctx)
    return f"note sent to {to}"


class Refund(BaseModel):
    refunded: str
    amount: int


@server.tool()
def refund(order: str, amount: int, ctx: Context) -> Refund:
    """Refund an order (needs a person's approval in the tests)."""
    record("refund", {"order": order, "amount": amount}, ctx)
    return Refund(refunded=order, amount=amount)


@server.tool()
def lookup(order: str) -> str:
    """Look an order up (no side effect)."""
    if order == "missing":
        raise ToolError(f"no order {order}")
    return f"order {order}: shipped"


if "--extra" in sys.argv:

    @server.tool()
    def archive(order: str) -> str:
        """Archive an order (listed only by the server's newer version)."""
        return f"archived {order}"


if __name__ == "__main__":
    if sys.argv[2:3] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
    else:
        server.run()
