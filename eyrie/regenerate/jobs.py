"""A record being regenerated (`Job`): its messages so far, the assistant turns still to do, and
each turn's prompt (`Request`); a backend's response (`Generated`) put in place of its turn, a
leading <think> block as its reasoning_content. The round loop: eyrie.regenerate.regeneration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eyrie.chat.encoding import ids_digest
from eyrie.chat.records import Conversation, RecordError, _one_line, content_text
from eyrie.chat.template import ChatTemplate

if TYPE_CHECKING:
    from eyrie.config.sections import RegenSettings

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
LEADING_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)


@dataclass(frozen=True)
class Generated:
    """A backend's response: its token ids without the end token, and whether it ended (an end
    token was generated) or was cut by the length limit."""

    ids: list[int]
    ended: bool
    end: int | None = None  # the end token generated

    @property
    def tokens(self) -> int:
        """Tokens generated, the end token included."""
        return len(self.ids) + int(self.ended)


def split_at_end(ids: list[int], ends: set[int]) -> Generated:
    """Generated token ids cut at the first end token (what follows it is padding)."""
    for k, token in enumerate(ids):
        if token in ends:
            return Generated(list(ids[:k]), True, token)
    return Generated(list(ids), False)


def opens_think(prompt: str) -> bool:
    """Whether the generation prompt leaves a <think> block open (the response starts inside)."""
    text = prompt.rstrip()
    return text.endswith(THINK_OPEN) and text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def parse_response(text: str, inside_think: bool = False) -> dict:
    """An assistant message from generated text: a leading <think>...</think> block becomes
    reasoning_content, the rest content. `inside_think`: the prompt opened the block."""
    if inside_think:
        text = THINK_OPEN + text
    match = LEADING_THINK.match(text)
    if match is None:
        if inside_think:  # never closed: all of it is reasoning
            return {
                "role": "assistant",
                "content": "",
                "reasoning_content": text[len(THINK_OPEN) :].strip(),
            }
        return {"role": "assistant", "content": text}
    message = {"role": "assistant", "content": text[match.end() :].lstrip()}
    if match.group(1).strip():
        message["reasoning_content"] = match.group(1).strip()
    return message


@dataclass
class Request:
    """One turn to generate: the record, the turn's message index, its prompt text and ids."""

    job: "Job"
    turn: int
    prompt: str
    ids: list[int]


@dataclass
class Job:
    """One record being regenerated: its messages so far and the assistant turns still to do."""

    sample_id: str
    messages: list[dict]
    tools: list[dict] | None
    pending: list[int]
    kept_tool_turns: int = 0
    generated: dict = field(default_factory=dict)  # turn -> its ids and prompt digest
    regenerated: int = 0
    tokens: int = 0
    status: str = "ok"
    detail: str = ""

    @classmethod
    def start(cls, sample_id: str, conv, turns: str) -> "Job":
        """The turns to regenerate: every assistant turn (`all`) or the last (`last`); a turn
        with tool_calls is kept as it is (the tool results that follow depend on it)."""
        assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        chosen = assistant if turns == "all" else assistant[-1:]
        pending = [i for i in chosen if not conv.messages[i].get("tool_calls")]
        messages = [dict(m) for m in conv.messages]
        return cls(sample_id, messages, conv.tools, pending, len(chosen) - len(pending))

    def request(self, tpl: ChatTemplate, cfg: RegenSettings, context: int | None) -> Request | None:
        """The next pending turn's prompt; None (the record failed) when it cannot be made."""
        turn = self.pending[0]
        try:
            prompt = tpl.render(self.messages[:turn], add_generation_prompt=True, tools=self.tools)
        except RecordError as err:
            self.fail(f"assistant turn {turn}: {err}")
            return None
        ids = list(tpl.tokenizer.encode(prompt, add_special_tokens=False))
        if context is not None and len(ids) + cfg.max_new_tokens > context:
            self.fail(
                f"assistant turn {turn}: its prompt of {len(ids)} tokens plus "
                f"regenerate.max_new_tokens={cfg.max_new_tokens} exceeds the target's "
                f"context of {context} tokens"
            )
            return None
        return Request(self, turn, prompt, ids)

    def accept(self, request: Request, generated: Generated, tokenizer, cfg: RegenSettings):
        """Put the response in place of its turn; a cut or empty response ends the record."""
        turn = self.pending.pop(0)
        text = tokenizer.decode(generated.ids, skip_special_tokens=False)
        self.messages[turn] = parse_response(text, opens_think(request.prompt))
        if generated.end is not None:  # the exact ids trained for this turn (eyrie.chat.turn)
            ids = [*generated.ids, generated.end]
            self.generated[turn] = {"ids": ids, "prompt": ids_digest(request.ids)}
        self.regenerated += 1
        self.tokens += generated.tokens
        if not generated.ended:
            self.status, self.pending = "cut", []
            self.detail = (
                f"assistant turn {turn}: the response hit regenerate.max_new_tokens="
                f"{cfg.max_new_tokens}"
            )
        elif not content_text(self.messages[turn]["content"]).strip():
            self.fail(f"assistant turn {turn}: the target's response has no text after its end")

    def fail(self, detail: str) -> None:
        self.status, self.detail, self.pending = "failed", _one_line(detail), []

    def line(self) -> dict:
        """The record's line of the output file (docs/contracts.md#files)."""
        record = Conversation(self.messages, self.tools).to_record()
        out = {"sample_id": self.sample_id, **record, "status": self.status}
        if self.status != "ok":
            out["detail"] = self.detail
        out["regenerated_turns"] = self.regenerated
        if self.status == "ok" and self.generated:
            out["generated"] = {str(turn): entry for turn, entry in self.generated.items()}
        return out
