"""A reply's text as it streams, without decoding the whole reply at every token."""

from __future__ import annotations


class ReplyText:
    """Incremental detokenization: decodes only the last few tokens at each step (O(1) per token, not O(n)).

    Holds back text that ends in an incomplete character (a multi-byte character split across tokens shows
    as U+FFFD until its last byte arrives); `final()` decodes the whole reply once, for the record.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the tokens decoded for context
        self._read = 0  # tokens whose text is already in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text

    def final(self) -> str:
        self.text = self._decode(self.ids)
        return self.text
