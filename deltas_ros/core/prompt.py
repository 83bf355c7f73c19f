"""Where the stream and a question sit in the chat template: one definition for the memory and
for training, so a trained model sees at inference exactly the layout it was trained on.

    <prefix: opens the user turn>  chunk 0  chunk 1 ...  <before> question <after: assistant turn>

The prefix tokens are the attention sinks; the question closes the user turn and opens the
assistant's, whose answer the model then writes. Qwen3.5's published template opens that turn
with a reasoning block (`<think>\n`) unless `enable_thinking` is passed as false, when it writes
an empty one (`<think>\n\n</think>\n\n`): the layout passes the flag, so a real checkpoint
answers at once unless thinking is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION_MARKER = "{question}"
THINK_END = "</think>"  # closes the reasoning block; the answer follows it


@dataclass(frozen=True)
class ChatLayout:
    """The stream's prefix and the text around a question, rendered by the tokenizer's template."""

    prefix: str
    before_question: str
    after_question: str

    @classmethod
    def from_tokenizer(cls, tokenizer, thinking: bool = False) -> ChatLayout:
        """Render one user turn holding a video and a question, and split it at both.
        thinking: the template's `enable_thinking` (a template without the rule ignores it)."""
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": QUESTION_MARKER}]}],
            tokenize=False, add_generation_prompt=True, enable_thinking=thinking,
        )
        if rendered.count(VIDEO_MARKER) != 1 or rendered.count(QUESTION_MARKER) != 1:
            raise ValueError("the tokenizer's chat template does not place a video in a user turn")
        prefix, suffix = rendered.split(VIDEO_MARKER)
        before, after = suffix.split(QUESTION_MARKER)
        return cls(prefix, before, after)

    @property
    def opens_reasoning(self) -> bool:
        """Whether the assistant turn starts inside an open reasoning block."""
        return self.after_question.rfind("<think>") > self.after_question.rfind(THINK_END)

    def question_ids(self, tokenizer, question: str) -> list[int]:
        """Token ids closing the user turn with `question` and opening the answer.

        The question is tokenized with special tokens split, so a question cannot close the turn
        or inject template markup of its own.
        """
        encode = tokenizer.encode
        return (encode(self.before_question, add_special_tokens=False)
                + encode(question, add_special_tokens=False, split_special_tokens=True)
                + encode(self.after_question, add_special_tokens=False))
