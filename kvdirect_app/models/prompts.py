"""Token ids of each user turn: the chat template's pieces for chat models, plain text otherwise."""

from __future__ import annotations

from ..plain.errors import UserError
from ..plain.scenarios import PRESETS_DIR
from .loading import LoadedModel


class InputError(UserError):
    """Bad input to a run (empty prompt, prompt longer than the context...)."""


class Prompter:
    """Token ids of each user turn: the chat template's pieces for chat models, plain text otherwise."""

    _U1, _A1, _U2 = "\u2063U1\u2063", "\u2063A1\u2063", "\u2063U2\u2063"

    def __init__(self, loaded: LoadedModel, raw: bool = False):
        self.tok = loaded.tokenizer
        self.chat = loaded.chat and not raw
        if self.chat:
            render = lambda msgs, gen: self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            a = render([{"role": "user", "content": self._U1}, {"role": "assistant", "content": self._A1}], False)
            b = render(
                [
                    {"role": "user", "content": self._U1},
                    {"role": "assistant", "content": self._A1},
                    {"role": "user", "content": self._U2},
                ],
                True,
            )
            if not b.startswith(a) or self._A1 not in a:
                raise InputError("this chat template does not extend turn by turn; use --raw")
            self.next_template = a[a.index(self._A1) + len(self._A1) :] + b[len(a) :]

    def encode(self, text: str, special: bool) -> list[int]:
        return self.tok(text, add_special_tokens=special)["input_ids"]

    def first(self, text: str) -> list[int]:
        if self.chat:
            rendered = self.tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return self.encode(rendered, False)
        return self.encode(text, True)

    def next(self, text: str, pending: int | None) -> list[int]:
        """The next turn: the unfed last token of the reply (if it was cut), the end of turn, the user turn."""
        body = self.next_template.replace(self._U2, text) if self.chat else "\n" + text
        return ([pending] if pending is not None else []) + self.encode(body, False)


def filler_ids(tokenizer, n: int) -> list[int]:
    """`n` token ids of the long-document preset, repeated as needed (deterministic): a context of exactly n."""
    text = (PRESETS_DIR / "long_document.md").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    more = tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids += more
    return ids[:n]
