"""The target's chat template applied as an inference server applies it.

`load_chat_tokenizer` loads the target's tokenizer (refusing a folder without tokenizer files,
`tokenizer_files_problem`, and a tokenizer without a chat template); `ChatTemplate` renders
messages through the tokenizer's own `apply_chat_template` (so remote code and its keywords take
effect) with `data.chat_template_kwargs`, after normalising them as vLLM's chat utilities do:
tool-call arguments given as JSON text reach the template as objects, or as text where the
template's own probe shows it concatenates them as strings (`tool_arguments`). `stops` are the
texts of the tokens generation stops on (the tokenizer's eos and generation_config.json's
eos_token_id list). What is trained from the renderings: eyrie.chat.samples, docs/data.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from eyrie.chat.forms import REASONING_MARKERS, TEMPLATE_MARKERS, content_format
from eyrie.chat.keywords import chat_template_kwargs, keyword_problems, tokenizer_code
from eyrie.chat.records import RecordError, _one_line
from eyrie.core.errors import DataError

# The files transformers builds a tokenizer from (its tokenizers' vocab_files_names): a fast
# tokenizer.json, a sentencepiece *.model (tokenizer.model, spiece.model, ...), BPE or WordPiece
# vocabularies, tiktoken ranks. A folder with none of them fails in transformers with several
# lines about sentencepiece, or loads as an empty tokenizer of 3 tokens.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def tokenizer_files_problem(folder: str | Path, trust_remote_code: bool = False) -> str | None:
    """One line naming `folder`, the files looked for and the fix when it has no tokenizer file;
    None when it has one, or when trusted remote code declares its own tokenizer class."""
    folder = Path(folder)
    if any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILES):
        return None
    if trust_remote_code:
        try:
            auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            auto_map = None
        if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
            return None  # the folder's own code decides which files it reads
    return (
        f"{folder}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); copy the "
        "model's tokenizer files into this folder, or set target.path to the folder that has them"
    )


def load_chat_tokenizer(target: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer; refuse a folder without tokenizer files or a tokenizer without a
    chat template."""
    from transformers import AutoTokenizer

    from eyrie.arch.target import read_config

    target = Path(target)
    if not target.is_dir():
        raise DataError(
            f"{target}: target folder not found; set target.path to a Hugging Face model folder"
        )
    problem = tokenizer_files_problem(target, trust_remote_code)
    if problem:
        raise DataError(problem)
    if (target / "config.json").is_file():
        read_config(target)  # a config.json that is not JSON is named as such, not as the tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        hint = (
            ""
            if trust_remote_code
            else " (set trust_remote_code: true if it ships tokenizer code you trust)"
        )
        raise DataError(f"{target}: cannot load the tokenizer: {_one_line(exc)}{hint}") from exc
    except Exception as exc:  # trusted code of the folder's own that raises (a missing package)
        if not trust_remote_code:
            raise
        raise DataError(
            f"{target}: its tokenizer code raised {type(exc).__name__}: {_one_line(exc)}; fix "
            "the tokenizer code in that folder, or install what it imports"
        ) from exc
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{target}: the tokenizer has no chat template; add chat_template.jinja (or "
            "'chat_template' in tokenizer_config.json) to the target folder"
        )
    return tokenizer


def generation_eos(target: str | Path):
    """The eos id(s) of the target's generation_config.json (else config.json), or None."""
    from eyrie.arch.target import read_config

    path = Path(target) / "generation_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise DataError(f"{path}: not a JSON object ({exc}); re-save the model") from exc
        if value is not None:
            return value
    config = read_config(target)
    return (config.get("text_config") or config).get("eos_token_id")


def end_token_ids(tokenizer, generation_eos=None) -> set[int]:
    """The ids that end a response: the tokenizer's eos and the generation config's eos ids."""
    ends = set()
    for value in (tokenizer.eos_token_id, generation_eos):
        if isinstance(value, int):
            ends.add(value)
        elif value:
            ends.update(int(v) for v in value)
    return ends


# A conversation with one tool call: how the template takes arguments (as an object, or as JSON
# text it concatenates) is read off its rendering of this, once.
PROBE_CALL_ARGUMENTS = {"city": "Oslo", "days": 2}


def _probe_call(arguments: object) -> list[dict]:
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "-3 C"},
        {"role": "assistant", "content": "Cold."},
    ]


ARGUMENT_FORMS = ("object", "string")

# the names beside reasoning_content templates read a turn's reasoning by: `reasoning` (vLLM
# passes the reasoning under both), `thinking` (gpt-oss)
REASONING_ALIASES = ("reasoning", "thinking")


def _arguments(value: object, form: str) -> object:
    """Tool-call arguments as the template takes them: parsed from JSON text (vLLM's
    normalisation; empty or missing: {}), or kept as (or made) JSON text."""
    if form == "object":
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return {} if value is None else value
    if isinstance(value, str):
        return value
    return json.dumps({} if value is None else value, ensure_ascii=False)


def _parts(content: object) -> list[dict]:
    """A message's content as text parts (a record's content is a string, text parts, or None:
    no parts)."""
    if isinstance(content, list):
        return [{"type": "text", "text": p["text"]} for p in content]
    return [] if content is None else [{"type": "text", "text": content}]


def _call(call: dict, form: str) -> dict:
    if isinstance(call.get("function"), dict):
        function = call["function"]
        return {
            **call,
            "function": {**function, "arguments": _arguments(function.get("arguments"), form)},
        }
    return {**call, "arguments": _arguments(call.get("arguments"), form)}


REASONING_FORMS = ("field", "chunks", "none")
PROBE_REASONING = "Eyrie probe reasoning."
PRINTED_PART = re.compile(r"""["']type["']\s*:""")  # a content part printed as data, not rendered


@dataclass(frozen=True)
class ChatTemplate:
    """The target's tokenizer and chat template, applied as an inference server applies them.

    `kwargs`: data.chat_template_kwargs, passed to every rendering; `tool_arguments`: how
    tool-call arguments reach the template (`object`: parsed from JSON text, as vLLM does;
    `string`: JSON text, for templates that concatenate them); `stops`: the texts of the tokens
    generation stops on; `content`: how message content reaches it (`string` | `openai` parts,
    vLLM's detection); `reasoning`: how a turn's reasoning reaches it (`field`:
    reasoning_content and its aliases; `chunks`: content parts of type "thinking"; `none`: the
    template renders none); `markers`: the reasoning block's start and end, or None.
    """

    tokenizer: object = field(repr=False)
    kwargs: dict = field(default_factory=dict)
    tool_arguments: str = "object"
    stops: tuple[str, ...] = ()
    content: str = "string"
    reasoning: str = "field"
    markers: tuple[str, str] | None = None

    @classmethod
    def of(
        cls, tokenizer, kwargs: dict | None = None, eos=None, reasoning_parser: str | None = None
    ) -> ChatTemplate:
        """The template of `tokenizer` with its switches; `eos`: generation_config.json's
        eos_token_id (an id or a list); `reasoning_parser`: a key of REASONING_MARKERS, else the
        markers are the first known pair whose start the template's source writes. The forms
        are read off the template."""
        ends = end_token_ids(tokenizer, eos)
        stops = tuple(sorted({tokenizer.decode([i], skip_special_tokens=False) for i in ends}))
        source = tokenizer.get_chat_template()
        markers = REASONING_MARKERS.get(reasoning_parser) if reasoning_parser else None
        known = dict.fromkeys([*REASONING_MARKERS.values(), *TEMPLATE_MARKERS])
        markers = markers or next((m for m in known if m[0] in source), None)
        switches = chat_template_kwargs(kwargs)
        problems = keyword_problems(switches, [source], tokenizer_code(tokenizer))
        if problems:
            raise DataError(problems[0])
        template = cls(tokenizer, switches, "object", stops, content_format(source))
        template = replace(template, markers=markers)
        template = replace(template, tool_arguments=template._argument_form())
        return replace(template, reasoning=template._reasoning_form())

    @classmethod
    def load(
        cls,
        target: str | Path,
        trust_remote_code: bool = False,
        kwargs: dict | None = None,
        reasoning_parser: str | None = None,
    ) -> ChatTemplate:
        """The target folder's template (load_chat_tokenizer's checks) with its stop tokens."""
        from eyrie.core.errors import TargetError

        tokenizer = load_chat_tokenizer(target, trust_remote_code)
        try:
            eos = generation_eos(target)
        except TargetError:  # a tokenizer-only folder: the tokenizer's eos alone
            eos = None
        return cls.of(tokenizer, kwargs, eos, reasoning_parser)

    def with_arguments(self, form: str) -> ChatTemplate:
        assert form in ARGUMENT_FORMS, form
        return replace(self, tool_arguments=form)

    def view(self, messages: list[dict], generated: int | None = None) -> list[dict]:
        """Messages as a server hands them to the template: tool-call arguments in the
        template's form, content as text or parts (`content`), the reasoning under
        REASONING_ALIASES or as a "thinking" part (`reasoning`). Message `generated` (the turn
        whose own rendering is read) keeps its text as the model writes it: a string."""
        out = []
        for k, message in enumerate(messages):
            message = dict(message)
            reasoning = message.get("reasoning_content")
            if reasoning is not None and self.reasoning != "chunks":
                for alias in REASONING_ALIASES:
                    message.setdefault(alias, reasoning)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    _call(c, self.tool_arguments) for c in message["tool_calls"]
                ]
            parts = _parts(message.get("content"))
            if self.reasoning == "chunks" and reasoning is not None:
                message.pop("reasoning_content")
                parts = [{"type": "thinking", "thinking": reasoning}, *parts]
                message["content"] = parts
            elif self.content == "openai" and k != generated and message["role"] != "tool":
                message["content"] = parts  # (vLLM hands a tool result on as text)
            else:
                message["content"] = "\n".join(p["text"] for p in parts)
            out.append(message)
        return out

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list | None = None,
        generated: int | None = None,
    ) -> str:
        """The template's text for `messages` (may be empty: then only what precedes turns);
        RecordError("template_error") with the template's own message when it fails."""
        try:
            view = self.view(messages, generated)
            if view:
                text = self.tokenizer.apply_chat_template(
                    view,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **self.kwargs,
                )
            else:  # apply_chat_template refuses an empty conversation (an assistant turn first)
                text = self._render_jinja(view, add_generation_prompt, tools)
        except Exception as exc:  # jinja errors and raise_exception() in templates have many types
            raise RecordError(
                "template_error",
                f"rendering {len(messages)} messages failed: {type(exc).__name__}: {exc}",
            ) from exc
        if not isinstance(text, str):
            raise RecordError(
                "template_error", f"apply_chat_template returned a {type(text).__name__}, not text"
            )
        return text

    def _render_jinja(self, view: list[dict], add_generation_prompt: bool, tools) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, _ = render_jinja_template(
            conversations=[view],
            tools=tools,
            chat_template=self.tokenizer.get_chat_template(tools=tools),
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **self.kwargs},
        )
        return texts[0]

    def _argument_form(self) -> str:
        """`object` unless the template fails on object arguments, or prints them as a Python
        dict, and takes JSON text (DeepSeek-V3.1 concatenates them as strings)."""
        try:
            text = self.render(_probe_call(PROBE_CALL_ARGUMENTS))
            if "'city'" not in text:
                return "object"
        except RecordError:
            pass
        try:
            self.with_arguments("string").render(_probe_call(PROBE_CALL_ARGUMENTS))
            return "string"
        except RecordError:
            return "object"  # no tool support: records with tool calls fail on their own

    def _reasoning_form(self) -> str:
        """`field` when the template renders a final turn's reasoning given as reasoning_content
        (and its aliases), else `chunks` when it renders it from a "thinking" content part,
        else `none`."""
        turn = {"role": "assistant", "content": "Seven.", "reasoning_content": PROBE_REASONING}
        messages = [{"role": "user", "content": "Name a prime number."}, turn]
        for form in ("field", "chunks"):
            try:
                text = replace(self, reasoning=form).render(messages)
            except RecordError:
                continue
            if PROBE_REASONING in text and not PRINTED_PART.search(text):
                return form
        return "none"
