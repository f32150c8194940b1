"""One pipeline per request: every API surface converts its request and shapes its answer, and the route from
there to the backend is one function, ``GatewayServing.serve`` (render, plan, body, dispatch), whatever the
surface or the backend kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway.serving
from gateway.entrypoints import chat, completions, messages, responses

SURFACES = (chat, completions, messages, responses)
# what decides how a plan reaches the backend: the swap, the kept tokens or the whole prompt, and the steps
ROUTING = {"swaps", "swapped", "forward", "kept", "kept_body", "planned", "plan", "position_ids", "passthrough"}


@pytest.mark.parametrize("module", SURFACES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_no_surface_branches_on_how_a_plan_reaches_the_backend(module):
    tree = ast.parse(Path(module.__file__).read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not used & ROUTING, f"{module.__name__} routes plans itself: {sorted(used & ROUTING)}"
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "serve"
    ]
    assert calls, f"{module.__name__} does not go through GatewayServing.serve"


def test_the_route_to_the_backend_is_one_function():
    """A chat's way from its surface to the backend: ``serve`` is where the three ways are chosen, and nothing
    else in the gateway calls the steps it strings together."""
    source = Path(gateway.serving.__file__).read_text()
    tree = ast.parse(source)
    serving = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GatewayServing")
    serve = next(n for n in serving.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "serve")
    called = {n.func.attr for n in ast.walk(serve) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"checked", "planned", "backend_body", "swapped", "kept", "forward"} <= called, called
    root = Path(gateway.serving.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "serving.py":
            continue
        tree = ast.parse(path.read_text())
        steps = {
            n.func.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("checked", "planned", "swapped")
        }
        assert not steps, f"{path.relative_to(root)} calls {sorted(steps)}: go through GatewayServing.serve"
