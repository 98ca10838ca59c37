"""The template switches (data.chat_template_kwargs): which keys a user may set (not
apply_chat_template's own) and which a template reads, so that a misspelt one is one line
instead of every record rendered without it. Read without loading a tokenizer where the
workflow parses (`folder_templates`), or off a loaded one (`tokenizer_code`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from eyrie.core.errors import DataError

# apply_chat_template's own arguments: data.chat_template_kwargs cannot set them
RESERVED_KWARGS = (
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "chat_template",
    "return_dict",
    "return_assistant_tokens_mask",
)


# What a template reads that no user switch sets: the tokenizer's special tokens and the helpers
# transformers and vLLM pass with every rendering, besides RESERVED_KWARGS
TEMPLATE_CONTEXT = (
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "raise_exception",
    "strftime_now",
    "date_string",
    "tools_in_user_message",
    "custom_tools",
    "builtin_tools",
)
# Template files a model folder may hold beside tokenizer_config.json's "chat_template"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja")


def template_variables(source: str) -> set[str] | None:
    """The variables a Jinja chat template reads from its context (jinja2.meta); None when its
    text does not parse outside transformers (the stages render it, and say what is wrong)."""
    import jinja2
    import jinja2.meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
    # transformers' {% generation %} marks (AssistantTracker): blocks, not variables
    text = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", source)
    try:
        return jinja2.meta.find_undeclared_variables(env.parse(text))
    except jinja2.TemplateError:
        return None


def folder_templates(folder: str | Path) -> tuple[list[str], list[str]]:
    """The chat templates a model folder holds (tokenizer_config.json's "chat_template", a
    string or a list of {name, template}, and TEMPLATE_FILES) and the text of its Python files
    (tokenizer code that may read a switch itself), read without loading a tokenizer."""
    folder = Path(folder)
    sources: list[str] = []
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for found in (config.get("chat_template"),) if isinstance(config, dict) else ():
        if isinstance(found, str):
            sources.append(found)
        elif isinstance(found, list):
            sources += [t["template"] for t in found if isinstance(t, dict) and "template" in t]
    for pattern in TEMPLATE_FILES:
        for path in sorted(folder.glob(pattern)):
            text = path.read_text(errors="replace")
            if path.suffix == ".json":
                try:
                    text = json.loads(text).get("chat_template", "")
                except (ValueError, AttributeError):
                    continue
            sources.append(text)
    code = [p.read_text(errors="replace") for p in sorted(folder.glob("*.py"))]
    return sources, code


def keyword_problems(
    kwargs: dict, sources: list[str], code: list[str], where: str = "data.chat_template_kwargs"
) -> list[str]:
    """A line for each switch in `kwargs` that no template in `sources` and no tokenizer code
    in `code` reads: a misspelt `enable_thinkin` would render every record without the switch,
    in silence. Nothing when a template does not parse here (the stages report it)."""
    if not kwargs or not sources:
        return []
    read: set[str] = set()
    for source in sources:
        names = template_variables(source)
        if names is None:
            return []
        read |= names
    problems = []
    for key in sorted(kwargs):
        if key in read or any(re.search(rf"\b{re.escape(key)}\b", text) for text in code):
            continue
        switches = sorted(read - set(RESERVED_KWARGS) - set(TEMPLATE_CONTEXT))
        problems.append(
            f"{where}.{key}: the chat template never reads it (it reads "
            f"{', '.join(switches) or 'no switch'}); fix the spelling or remove it"
        )
    return problems


def chat_template_kwargs(value: object, where: str = "data.chat_template_kwargs") -> dict:
    """The template switches, checked: an object whose keys are not apply_chat_template's own."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where}: must be a mapping of template switches, e.g. {{thinking: true}}")
    taken = sorted(set(value) & set(RESERVED_KWARGS))
    if taken:
        raise DataError(
            f"{where}.{taken[0]}: set by eyrie for each rendering; remove it (the template "
            "switches are the template's own variables, e.g. enable_thinking)"
        )
    return dict(value)


def tokenizer_code(tokenizer) -> list[str]:
    """The source of a tokenizer's class when it is not transformers' own (remote code), which
    may read a template switch itself."""
    import inspect

    cls = type(tokenizer)
    if cls.__module__.startswith("transformers."):
        return []
    try:
        return [Path(inspect.getsourcefile(cls)).read_text(errors="replace")]
    except (OSError, TypeError):
        return []
