"""How a chat template takes what a server hands it, read off the template's source: the content
format vLLM detects (`content_format`) and the reasoning markers a template writes
(`REASONING_MARKERS`, by vLLM reasoning-parser name, and `TEMPLATE_MARKERS`).
"""

from __future__ import annotations

# The reasoning markers of the templates vLLM's reasoning parsers read (start, end), by parser
# name: data.reasoning_parser picks one where the template alone cannot tell.
REASONING_MARKERS = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "minimax_m2": ("<think>", "</think>"),
    "kimi_k2": ("<think>", "</think>"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "mistral": ("[THINK]", "[/THINK]"),
}
# reasoning markers of templates vLLM has no parser name for, read off their sources
TEMPLATE_MARKERS = (
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command A (reasoning)
    ("<|channel>", "<channel|>"),  # Gemma 4
    ("<|think|>", "<|end|>"),  # Solar Open
)


def content_format(source: str) -> str:
    """How a server hands this template a message's content, detected as vLLM detects it:
    `openai` (a list of parts) when the template loops over a message's content (a loop over
    `message['content']`, `message.content`, filtered or sliced, where `message` is a loop
    variable over `messages` or a variable set from it; or over a variable named `content`),
    else `string` (text parts joined with "\n")."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(source).environment.parse(source)
    except Exception:  # noqa: BLE001 - a template that does not parse: vLLM's default, text
        return "string"
    lists = ["messages"]
    for name in lists:  # variables set from messages (or from one another), breadth first
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if _reads(assign.node, name) and isinstance(target, nodes.Name):
                if target.name not in lists:
                    lists.append(target.name)
    loops = list(tree.find_all(nodes.For))
    items = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, n) for n in lists)
    }
    for loop in loops:
        if any(_reads(loop.iter, item, "content") for item in items):
            return "openai"
        if isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def _reads(node, name: str, key: str | None = None) -> bool:
    """Whether a jinja expression reads variable `name` (or its item `key`), through filters,
    tests and slices."""
    from jinja2 import nodes

    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, name)
        )
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _reads(node.node, name)
    return False
